"""The attacks of issue 34 on the autograder, planted in submissions of the course fixture
(tests/fixtures/course/01_fixture.ipynb) and graded in one run of ``python -m gptlab grade``:
each scores 0, is refused ("not graded") or is flagged, touches only its own row, and no honest
submission loses a point. The capstone goes through the same sandbox (a few minutes: its Part 4
trains twice). Every submission runs in the sandbox (bubblewrap): these tests skip
where it is not installed (.ci/run installs it)."""

import csv
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from test_course import (CAPSTONE, CAPSTONE_PLANTS, FIXTURE, HONEST, STYLES, ZERO_EX1, ZERO_EX2,
                         _answered, _cell)

from gptlab.cli import main
from gptlab.course import autograde, sandbox
from gptlab.course import editions as course

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is "
                                 "not installed: apt-get install bubblewrap"),
              pytest.mark.timeout(1800)]
ZERO = {"ex1": ZERO_EX1, "ex2": ZERO_EX2}

# Issue 34's attacks: student -> (a cell run before the answers, or None; the answers). The
# answers are wrong (zeros) unless the attack works. {csv}, {submitted}, {port}, {repository}:
# what a student who guessed the grader's paths would write.
ATTACKS = {
    # faking or skipping the verdict from inside the kernel
    "hook-execute-result": ("""ip = get_ipython()

def _credit(info):
    ip.displayhook(4)

ip.events.register("pre_run_cell", _credit)
""", ZERO),
    "input-transformer": ("""get_ipython().input_transformers_cleanup.append(
    lambda lines: ["pass\\n"] if lines and lines[0].startswith("# Grading cell") else lines)
""", ZERO),
    # changing what the checker calls
    "builtins-all": ("""import builtins, sys
_real_all = builtins.all

def _all(iterable):
    if sys._getframe(1).f_globals.get("__name__") == "gptlab.course.grading":
        return True
    return _real_all(iterable)

builtins.all = _all
""", ZERO),
    "fake-grading-module": ("""import sys, types
_fake = types.ModuleType("gptlab.course.grading")

class _Passed:
    passed = True
    def assert_ok(self):
        pass

_fake.cases = lambda *args, **kwargs: {}
_fake.check_backward = _fake.check_function = lambda *args, **kwargs: _Passed()
vars(sys)["modules"]["gptlab.course.grading"] = _fake
""", ZERO),
    "numpy-code-swap": ("""np.allclose._implementation.__code__ = (
    lambda a, b, rtol=1e-05, atol=1e-08, equal_nan=False: True).__code__
""", ZERO),
    "checker-frame": (None, {"ex1": ZERO_EX1, "ex2": """import sys

def softmax(x):
    frame = sys._getframe(1)
    while frame is not None:
        if "want" in frame.f_locals:
            return frame.f_locals["want"]
        frame = frame.f_back
    return np.zeros_like(x)
"""}),
    # reading what it should not
    "model-answer-from-workspace": ("""import glob, json, os
_found = glob.glob(os.path.join(os.getcwd(), "../../../source/*/*.ipynb"))
_found += glob.glob("/tmp/gptlab-course-*/**/*.ipynb", recursive=True)
_found += glob.glob({repository!r} + "/tests/fixtures/course/*.ipynb")
for _path in _found:
    try:
        for _c in json.load(open(_path))["cells"]:
            if "### BEGIN SOLUTION" in "".join(_c["source"]):
                exec("".join(_c["source"]))
    except Exception:
        pass
""", ZERO),
    "overwrite-others": ("""import glob
_blank = open(glob.glob({submitted!r} + "/untouched/*.ipynb")[0]).read() if glob.glob(
    {submitted!r} + "/untouched/*.ipynb") else "{}"
for _path in (glob.glob("/tmp/gptlab-course-*/**/*.ipynb", recursive=True)
              + glob.glob({submitted!r} + "/zz-victim/*.ipynb")):
    if "overwrite-others" not in _path:
        try:
            open(_path, "w").write(_blank)
        except OSError:
            pass
for _db in glob.glob("/tmp/gptlab-course-*/**/gradebook.db", recursive=True):
    try:
        open(_db, "ab").write(b"extra_credit")
    except OSError:
        pass
""", ZERO),
    # autograd by another door
    "second-engine": (None, {"ex1": """def rmsnorm_backward(dy, cache):
    import torch
    engine = torch._C._ImperativeEngine()
    xhat, w, rstd = cache
    x, wt = torch.tensor(xhat / rstd, requires_grad=True), torch.tensor(w, requires_grad=True)
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * wt
    dx, dw = engine.run_backward((y,), (torch.tensor(dy),), False, False, (x, wt), False)
    return dx.numpy(), dw.numpy()
""", "ex2": ZERO_EX2}),
    "grad-fn-by-hand": (None, {"ex1": """def rmsnorm_backward(dy, cache):
    import torch
    xhat, w, rstd = cache
    x, wt = torch.tensor(xhat / rstd, requires_grad=True), torch.tensor(w, requires_grad=True)
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * wt
    grads, stack = {}, [(y.grad_fn, torch.tensor(dy))]
    while stack:
        node, g = stack.pop()
        if node is None:
            continue
        if type(node).__name__ == "AccumulateGrad":
            grads[id(node.variable)] = grads.get(id(node.variable), 0) + g
            continue
        outs = node(g)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for (after, _), out in zip(node.next_functions, outs):
            if out is not None:
                stack.append((after, out))
    return grads[id(x)].numpy(), grads[id(wt)].numpy()
""", "ex2": ZERO_EX2}),
    # outliving the grader
    "detached-rewrite": ("""import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import os, time\\n"
                  "for _ in range(600):\\n"
                  "    if os.path.exists({csv!r}):\\n"
                  "        time.sleep(1)\\n"
                  "        open({csv!r}, 'a').write('detached-rewrite,all,total,9,9,\\\\n')\\n"
                  "        break\\n"
                  "    time.sleep(0.2)\\n"], start_new_session=True)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", {csv!r}],
                 start_new_session=True)
""", ZERO),
    # one submission stops everyone
    "kill-the-grader": ("""import os, signal
try:
    os.kill(os.getppid(), signal.SIGKILL)
except OSError:
    pass
os.kill(os.getpid(), signal.SIGKILL)
""", HONEST),
    # feedback leaks the hidden tests
    "leak-hidden-tests": (None, {"ex1": """import glob, sys

def rmsnorm_backward(dy, cache):
    print(get_ipython().user_ns["In"][-1], file=sys.stderr)
    for path in glob.glob("/tmp/gptlab-course-*/**/01_fixture.ipynb", recursive=True):
        print(open(path).read(), file=sys.stderr)
    return np.zeros_like(dy), np.zeros_like(cache[1])
""", "ex2": ZERO_EX2}),
    # limits and noise
    "limits": ("""import os, socket, threading
print("uid", os.getuid())
try:
    _big = np.ones(2**28)
    print("allocated 2 GiB")
except MemoryError:
    print("2 GiB refused: MemoryError")
try:
    with open("big.bin", "wb") as f:
        f.write(b"0" * (100 * 2**20))
    print("wrote 100 MiB")
except OSError as error:
    print("100 MiB file refused:", error)
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3).close()
    print("connected to the grader's machine")
except OSError as error:
    print("network refused:", error)
_stop = threading.Event()  # the threads end at once: the limit is its user's, for a moment
try:
    for _ in range(400):
        threading.Thread(target=_stop.wait).start()
    print("400 threads started")
except RuntimeError as error:
    print("400 threads refused:", error)
finally:
    _stop.set()
try:
    import torch
    print("torch imported")
except ImportError as error:
    print("torch refused:", error)
print("sees the chapters:", os.path.exists({repository!r} + "/book"),
      os.path.exists({repository!r} + "/tests/fixtures/course/01_fixture.ipynb"))
""", ZERO),
}
# Honest work under names and styles a grader must take: student -> answers.
def _style(name: str) -> dict:
    return dict(zip(("ex1", "ex2"), STYLES[name]))


HONEST_NAMES = {"zz-victim": HONEST, "José": _style("float32"), "ünïcødé": _style("colab")}


def _guessed(code: str, paths: dict) -> str:
    """``code`` with the grader's paths a student guessed written in (``{csv!r}``, ``{port}``)."""
    for name, value in paths.items():
        code = code.replace(f"{{{name}!r}}", repr(value)).replace(f"{{{name}}}", str(value))
    return code


def _planted(student_nb, extra: str | None, answers: dict):
    nb = _answered(student_nb, answers)
    if extra is not None:  # right after the imports, before any answer
        nb.cells.insert(3, nbformat.v4.new_code_cell(extra))
    return nb


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One grading run of every attack, the honest work and the bad hand-ins, with the command
    line; then a wait, for what a detached process would do after it."""
    tmp = tmp_path_factory.mktemp("sandboxed")
    submitted, out = tmp / "submitted", tmp / "grades.csv"
    edition = course.student_edition(tmp / "student", FIXTURE.parent, [FIXTURE.stem])
    student_nb = nbformat.read(edition.notebooks[0], as_version=4)
    listener = socket.create_server(("127.0.0.1", 0))
    paths = dict(csv=str(out), submitted=str(submitted), port=listener.getsockname()[1],
                 repository=str(ROOT))
    hand_ins = {"untouched": student_nb}
    for student, (extra, answers) in ATTACKS.items():
        hand_ins[student] = _planted(student_nb, extra and _guessed(extra, paths), answers)
    for student, answers in HONEST_NAMES.items():
        hand_ins[student] = _answered(student_nb, answers)
    copied = _answered(student_nb, _style("jupyterlab"))
    hand_ins["copy-a"] = hand_ins["copy-b"] = copied
    hand_ins["copy-renamed"] = _answered(student_nb, {  # names, comments and layout changed
        exercise: code.replace("flat_dy", "rows_dy").replace("shifted", "z").replace(
            "    g = dy * w", "    # the gradient through the gain\n    g = dy  *  w")
        for exercise, code in _style("jupyterlab").items()})
    for student, nb in hand_ins.items():
        (submitted / student).mkdir(parents=True)
        nbformat.write(nb, submitted / student / FIXTURE.name)
    nbformat.write(_answered(student_nb, _style("out-of-order")), tmp / "shared.ipynb")
    for student in ("link-1", "link-2", "link-3"):  # identical hand-ins by symlink
        (submitted / student).mkdir()
        (submitted / student / FIXTURE.name).symlink_to(tmp / "shared.ipynb")
    (submitted / "dir-as-notebook" / FIXTURE.name).mkdir(parents=True)
    (submitted / "fifo").mkdir()
    os.mkfifo(submitted / "fifo" / FIXTURE.name)
    (submitted / "newline\n").mkdir()
    nbformat.write(_answered(student_nb, HONEST), submitted / "newline\n" / FIXTURE.name)

    start = time.perf_counter()
    status = main(["grade", str(submitted), "--source", str(FIXTURE.parent), "--out", str(out),
                   "--autograded", str(tmp / "autograded"), "--jobs", "2", "--timeout", "60",
                   "--notebook-timeout", "120"])
    seconds = time.perf_counter() - start
    written = out.read_text()
    time.sleep(3)  # a detached process would rewrite the CSV now
    listener.settimeout(0.1)
    try:
        listener.accept()[0].close()
        connected = True
    except TimeoutError:
        connected = False
    listener.close()
    left = _lingering(str(out))
    rows = {}
    for line in written.splitlines()[1:]:
        student, chapter, exercise, points, _, flags = next(csv.reader([line]))
        rows.setdefault(student, {})[exercise] = (float(points), flags)
    return dict(tmp=tmp, status=status, csv=out, written=written, rows=rows, seconds=seconds,
                connected=connected, left=left, source_nb=nbformat.read(FIXTURE, as_version=4))


def _lingering(token: str) -> set[tuple]:
    """The processes (pid, command line) whose command line holds ``token``."""
    return {(p.info["pid"], " ".join(p.info["cmdline"])) for p in
            psutil.process_iter(["pid", "cmdline"]) if token in " ".join(p.info["cmdline"] or [])}


def _feedback(run, student: str) -> str:
    return (run["tmp"] / "autograded" / student / FIXTURE.name).read_text(encoding="utf-8")


@pytest.mark.parametrize("student", list(ATTACKS))
def test_every_attack_scores_zero(run, student):
    total, _ = run["rows"][student]["total"]
    assert total == 0, (student, run["rows"][student])


def test_honest_work_keeps_its_points_whatever_the_others_did(run):
    """The victim of the overwriting attack, names in any alphabet, honest identical copies."""
    for student in [*HONEST_NAMES, "copy-a", "copy-b", "copy-renamed"]:
        assert run["rows"][student]["ex1"][0] == 4 and run["rows"][student]["ex2"][0] == 2, \
            (student, run["rows"][student])


def test_a_bad_hand_in_is_its_own_row_not_graded_and_the_csv_is_written(run):
    assert run["status"] == 1  # some submissions not graded
    reasons = {student: run["rows"][student] for student in
               ("dir-as-notebook", "fifo", "link-1", "kill-the-grader", "newline\\n")}
    for student, row in reasons.items():
        assert row["not graded"][0] == 0 and row["total"][0] == 0, (student, row)
    log = (run["csv"].with_suffix(".logs") / "fifo.log").read_text()
    assert "not a regular file" in log
    assert "is a directory" in (run["csv"].with_suffix(".logs") / "dir-as-notebook.log").read_text()
    assert "is a symlink" in (run["csv"].with_suffix(".logs") / "link-1.log").read_text()
    assert "not a plain name" in (run["csv"].with_suffix(".logs") / "newline\\n.log").read_text()


def test_nothing_outlives_grading_to_change_the_grades(run):
    assert run["csv"].read_text() == run["written"]
    assert "detached-rewrite,all,total,0," in run["written"]
    assert run["left"] == set(), run["left"]


def test_the_sandbox_has_limits_no_network_no_root_no_torch_no_chapters(run):
    text = _feedback(run, "limits")
    uid = int(re.search(r"uid (\d+)", text).group(1))
    assert sandbox.NOBODY - 2 < uid <= sandbox.NOBODY  # one user per sandbox running at once
    for said in ("2 GiB refused: MemoryError", "100 MiB file refused",
                 "network refused", "400 threads refused", "torch refused",
                 "sees the chapters: False False"):
        assert said in text, said
    assert not run["connected"]


def test_identical_hand_ins_are_flagged(run):
    rows = run["rows"]
    assert "identical to the hand-in of copy-b" in rows["copy-a"]["ex1"][1]
    assert "identical to the hand-in of copy-a" in rows["copy-b"]["ex1"][1]
    assert "the same code, up to names, comments and layout, as the hand-in of copy-a, copy-b" \
        in rows["copy-renamed"]["ex1"][1], rows["copy-renamed"]
    for student in ("link-1", "link-2", "link-3"):
        assert "the same file as the hand-in of" in rows[student]["total"][1], rows[student]
    assert rows["zz-victim"]["total"][1] == "" and rows["José"]["total"][1] == ""


def test_no_feedback_holds_a_hidden_test(run):
    """Every feedback notebook, sources and outputs, against every line of the hidden tests
    (a line that is not also outside them)."""
    hidden = re.escape(course.HIDDEN[0]) + "(.*?)" + re.escape(course.HIDDEN[1])
    cells = [c.source for c in run["source_nb"].cells]
    outside = "\n".join(re.sub(hidden, "", source, flags=re.S) for source in cells)
    lines = {line.strip() for source in cells for region in re.findall(hidden, source, re.S)
             for line in region.splitlines() if line.strip() and line.strip() not in outside}
    assert lines
    feedback = sorted((run["tmp"] / "autograded").glob("*/*.ipynb"))
    assert len(feedback) > len(ATTACKS)
    for path in feedback:
        text = json.dumps(json.loads(path.read_text(encoding="utf-8")))
        for line in lines:
            assert json.dumps(line)[1:-1] not in text, (path, line)
    assert "rmsnorm_backward" in _feedback(run, "leak-hidden-tests")


def test_a_notebook_past_its_wall_clock_limit_is_ended(tmp_path):
    edition = course.student_edition(tmp_path / "student", FIXTURE.parent, [FIXTURE.stem])
    student_nb = nbformat.read(edition.notebooks[0], as_version=4)
    slow = _answered(student_nb, HONEST)
    for _ in range(6):
        slow.cells.insert(3, nbformat.v4.new_code_cell("import time\ntime.sleep(5)"))
    (tmp_path / "submitted" / "slow").mkdir(parents=True)
    nbformat.write(slow, tmp_path / "submitted" / "slow" / FIXTURE.name)
    start = time.perf_counter()
    grades = autograde.grade(tmp_path / "submitted", FIXTURE.parent, timeout=8,
                             limits=sandbox.Limits(wall_seconds=12))
    assert time.perf_counter() - start < 60
    assert [r.exercise for r in grades.rows] == ["not graded"]
    assert "ran past its time limit" in grades.failed[0]


def test_grade_refuses_without_the_sandbox_unless_told(tmp_path, monkeypatch, capsys):
    edition = course.student_edition(tmp_path / "student", FIXTURE.parent, [FIXTURE.stem])
    honest = _answered(nbformat.read(edition.notebooks[0], as_version=4), HONEST)
    (tmp_path / "submitted" / "ann").mkdir(parents=True)
    nbformat.write(honest, tmp_path / "submitted" / "ann" / FIXTURE.name)

    def no_sandbox():
        raise sandbox.SandboxError("the sandbox cannot start here: no user namespaces")

    monkeypatch.setattr(sandbox, "check", no_sandbox)
    command = ["grade", str(tmp_path / "submitted"), "--source", str(FIXTURE.parent),
               "--out", str(tmp_path / "grades.csv")]
    assert main(command) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "--unsafe-no-sandbox" in said[0], said
    assert not (tmp_path / "grades.csv").exists()
    assert main([*command, "--unsafe-no-sandbox"]) == 0
    assert "ann,all,total,6,6," in (tmp_path / "grades.csv").read_text()


def test_the_capstone_is_graded_in_the_sandbox_too(tmp_path):
    """The capstone's model answers earn every point through the sandbox and the channel (its
    Part 4 trains in the sandbox), and a Part 1 built from gptlab.layers fails there too."""
    source_nb = nbformat.read(CAPSTONE, as_version=4)
    answer, _, (right, wrong), message = CAPSTONE_PLANTS["part 1 from gptlab.layers"]
    cheat = nbformat.from_dict(json.loads(json.dumps(source_nb)))
    _cell(cheat, f"{answer}_answer").source = _cell(cheat, f"{answer}_answer").source.replace(
        right, wrong)
    for student, nb in (("model", source_nb), ("layers", cheat)):
        (tmp_path / "submitted" / student).mkdir(parents=True)
        nbformat.write(nb, tmp_path / "submitted" / student / CAPSTONE.name)
    grades = autograde.grade(tmp_path / "submitted", CAPSTONE.parent, [CAPSTONE.stem], jobs=2,
                             autograded=tmp_path / "autograded")
    points = {(r.student, r.exercise): (r.points, r.max_points) for r in grades.rows}
    assert not grades.failed, grades.failed
    assert all(got == most for (student, _), (got, most) in points.items()
               if student == "model"), points
    assert points["layers", "ex1"] == (0.0, 4.0)
    assert message in (tmp_path / "autograded" / "layers" / CAPSTONE.name).read_text()
