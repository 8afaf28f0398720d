"""What the book and the course add on top of the package. Book: every chapter; docs/COURSE.md.

    source.py     ``show_source``: a chapter's listing read from the package's own file
    errata.py     the seeds' mistakes, kept runnable so a chapter can show them failing
    grading.py    the autograder's checks (``check_backward``, ``check_function``, ``cases``)
    editions.py   the student and instructor editions and grading, over nbgrader

May import: ``gptlab.gradcheck`` and everything below it (the layers, the model, the backend);
nothing of training, so a grader never depends on the code a student is asked to write there.
"""
