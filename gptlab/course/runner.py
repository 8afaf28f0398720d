"""What runs in a submission's sandbox: ``python -m gptlab.course.runner CELLS TIMEOUT IN OUT``.

It runs the student's code cells (``CELLS``: a JSON list of sources; the grading cells are not
among them) one after the other in an IPython shell, ``TIMEOUT`` seconds each, and sends their
outputs on descriptor ``OUT``. Then it answers the grader's calls, read on descriptor ``IN``:
call the student's function ``name`` on these inputs under this guard, and send back the result
(gptlab.course.wire), what the call warned or printed on stderr, and the inputs it changed.
Nothing here decides a grade: the grader checks the results in its own process.
"""

from __future__ import annotations

import json
import signal
import sys
import traceback
from contextlib import nullcontext

from . import wire
from .grading import recorded, spec_bodies, watch

MAX_TEXT = 20_000  # characters of one output kept for the feedback
MAX_SAID = (20, 500)  # lines and characters a call's warnings and stderr keep in its report
MIME_TYPES = ("text/plain", "text/html", "text/markdown", "text/latex", "image/png")


def _alarm(signum, frame):
    raise TimeoutError("the cell ran past its time limit")


def _outputs(captured, result) -> list[dict]:
    """A cell's outputs as nbformat dicts: its streams, displays, result and error."""
    outputs = [{"output_type": "stream", "name": name, "text": text[:MAX_TEXT]}
               for name, text in (("stdout", captured.stdout), ("stderr", captured.stderr)) if text]
    for shown in captured.outputs:
        outputs.append({"output_type": "display_data", "metadata": {},
                        "data": {k: v for k, v in shown.data.items() if k in MIME_TYPES}})
    if result.result is not None:
        outputs.append({"output_type": "execute_result", "metadata": {}, "execution_count": None,
                        "data": {"text/plain": repr(result.result)[:MAX_TEXT]}})
    error = result.error_before_exec or result.error_in_exec
    if error is not None:
        outputs.append({"output_type": "error", "ename": type(error).__name__,
                        "evalue": str(error)[:MAX_TEXT], "traceback": []})
    return outputs


def run_cells(shell, sources: list[str], timeout: int) -> list[list[dict]]:
    from IPython.utils.capture import capture_output

    signal.signal(signal.SIGALRM, _alarm)
    done = []
    for source in sources:
        signal.alarm(timeout)
        try:
            with capture_output() as captured:
                result = shell.run_cell(source, store_history=True)
        finally:
            signal.alarm(0)
        done.append(_outputs(captured, result))
    return done


def serve(namespace: dict, fd_in: int, fd_out: int) -> None:
    """Answer the grader's requests until it stops: ``{"name", "args", "kwargs", "spec"}``."""
    handles: dict[int, object] = {}

    def keep(obj) -> int:
        handles[len(handles)] = obj
        return len(handles) - 1

    while True:
        try:
            request = wire.load_request(wire.read_message(fd_in), handles)
        except wire.ChannelError:
            return
        args, kwargs, said = request["args"], request["kwargs"], []
        before = [leaf.copy() for leaf in wire.array_leaves((args, kwargs))]
        try:
            fn = namespace.get(request["name"])
            if not callable(fn):
                raise NameError(f"{request['name']} is not defined (or not a function) "
                                "in the notebook")
            guarded = watch(*spec_bodies(request["spec"])) if request["spec"] else nullcontext()
            with recorded(said), guarded:
                value = fn(*args, **kwargs)
            answer = {"value": value}
        except BaseException as error:  # the student's code may raise anything, exit included
            answer = {"error": type(error).__name__, "message": str(error)[:MAX_TEXT]}
        answer["said"] = [line[:MAX_SAID[1]] for line in said[:MAX_SAID[0]]]
        answer["changed"] = [(k, leaf) for k, (leaf, old) in
                             enumerate(zip(wire.array_leaves((args, kwargs)), before))
                             if leaf.shape == old.shape and leaf.tobytes() != old.tobytes()]
        try:
            message = wire.encode(answer, keep)
        except Exception as error:  # an answer that cannot be sent: say so
            message = wire.encode({"error": "TypeError", "said": [],
                                   "message": f"the result cannot be sent: {error}"[:MAX_TEXT]})
        wire.write_message(fd_out, message)


def main(argv: list[str]) -> None:
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    cells, timeout, fd_in, fd_out = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    with open(cells) as f:
        sources = json.load(f)
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    config.InteractiveShell.colors = "nocolor"  # tracebacks as plain text in the feedback
    shell = InteractiveShell.instance(config=config)
    try:
        outputs = run_cells(shell, sources, timeout)
    except BaseException:  # the shell itself broke: say so, the grader decides
        outputs = [[{"output_type": "error", "ename": "RunnerError",
                     "evalue": traceback.format_exc(limit=1)[-MAX_TEXT:], "traceback": []}]]
    wire.write_message(fd_out, wire.encode({"cells": outputs}))
    serve(shell.user_ns, fd_in, fd_out)


if __name__ == "__main__":
    main(sys.argv[1:])
