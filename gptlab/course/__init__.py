"""What the book and the course add on top of the package. Book: every chapter; docs/COURSE.md.

    source.py     ``show_source``: a chapter's listing read from the package's own file
    errata.py     the seeds' mistakes, kept runnable so a chapter can show them failing
    grading.py    the autograder's checks (``check_backward``, ``check_function``, ``cases``)
    editions.py   the student and instructor editions, over nbgrader
    autograde.py  ``grade``: each submission in a sandbox, its grading cells in the grader
    sandbox.py    the sandbox (bubblewrap, limits); runner.py what runs in it
    wire.py       the narrow channel between them: arrays and numbers, no pickle from a student
    integrity.py  what is flagged for a person, and which hand-ins are refused

May import: ``gptlab.gradcheck`` and everything below it (the layers, the model, the backend);
nothing of training, so a grader never depends on the code a student is asked to write there.
"""
