"""The sandbox a submission runs in (docs/COURSE.md, "The sandbox").

Each submission runs :mod:`gptlab.course.runner` under Debian's ``bubblewrap`` (``bwrap``): new
PID, network, IPC and UTS namespaces (no network but loopback; every process of the submission
ends with it), a root file system of read-only binds (the system's ``/usr``, Python, the
virtual environment and the ``gptlab`` package only) and one writable folder, its own home.
The grading workspace, the chapters, the other submissions and the grades are not in it. It runs
as ``nobody`` (uid 65534; 65533, ... for the sandboxes running beside it) without capabilities,
under limits (``prlimit``) on memory, CPU time, processes, open files and file size; the grader
ends it at its wall-clock limit. Where a chapter's imports do not need torch, torch's folder is
replaced by one whose import fails.

``unsafe=True`` runs the same program without the sandbox (limits and process group only), for
an instructor who asked for it (``grade --unsafe-no-sandbox``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534  # the sandbox's user; N sandboxes at once are NOBODY, NOBODY - 1, ...
HOME = "/home/student"  # the submission's folder, as it sees it
HIDDEN_MODULES = ("torch", "functorch")  # what a NumPy chapter's sandbox cannot import
PACKAGE = Path(__file__).resolve().parent.parent  # gptlab, bound read-only
PYTHON = os.path.abspath(sys.executable)  # this interpreter, its links kept (a virtualenv's)
WARM = "import importlib.util\nif importlib.util.find_spec('matplotlib'):\n" \
       "    import matplotlib.font_manager"
DECOY = "raise ModuleNotFoundError('torch cannot be imported while a NumPy exercise is graded')\n"

__all__ = ["HOME", "Limits", "SandboxError", "check", "start"]


class SandboxError(RuntimeError):
    """The sandbox cannot start here; the message says why and what to do."""


@dataclass(frozen=True)
class Limits:
    """What one submission may use: memory (MiB of data), CPU seconds, processes and threads of
    its user, file size (MiB), and wall-clock seconds for its whole notebook and checks."""

    memory_mib: int = 2048
    cpu_seconds: int = 1200
    processes: int = 256
    file_mib: int = 64
    wall_seconds: float = 1200.0


def _prlimit(limits: Limits) -> list[str]:
    return ["prlimit", f"--data={limits.memory_mib * 2**20}", f"--cpu={limits.cpu_seconds}",
            f"--nproc={limits.processes}", f"--fsize={limits.file_mib * 2**20}",
            "--nofile=256", "--core=0", "--"]


def _read_only() -> list[str]:
    """The binds of the system, Python, the virtual environment and the package."""
    args = []
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in ("/etc/ld.so.cache", "/etc/fonts", "/etc/localtime"):
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    for path in dict.fromkeys([sys.base_prefix, sys.prefix, str(PACKAGE)]):
        if not path.startswith(("/usr/", "/bin/", "/lib")):
            args += [*_parents(path), "--ro-bind", path, path]
    return args


def _parents(path: str, top: str = "/") -> list[str]:
    """Arguments that make the folders between ``top`` and ``path`` readable by anyone (bwrap
    makes them readable by root only)."""
    return [arg for parent in reversed(Path(path).parents) if parent.is_relative_to(top)
            and str(parent) != top for arg in ("--perms", "0755", "--dir", str(parent))]


def _hidden(decoy: Path) -> list[str]:
    """Binds of ``decoy`` over torch's folders, so that ``import torch`` fails."""
    args = []
    for name in HIDDEN_MODULES:
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            args += ["--ro-bind", str(decoy), folder]
    return args


def _environment() -> dict:
    return {"PATH": f"{os.path.dirname(PYTHON)}:/usr/bin:/bin", "HOME": HOME,
            "PYTHONPATH": str(PACKAGE.parent), "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8",
            "MPLBACKEND": "Agg", "MPLCONFIGDIR": f"{HOME}/.matplotlib",
            "IPYTHONDIR": f"{HOME}/.ipython", "GPTLAB_GRADING": "1",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _bwrap(home: Path, data: dict[str, Path], hide_torch: bool, decoy: Path,
           uid: int) -> list[str]:
    """The ``bwrap`` command line up to the program it runs (as ``uid``)."""
    if os.geteuid() == 0:  # no user namespace: setpriv makes the program uid, capabilities gone
        users = []
        become = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                  "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    else:  # inside a user namespace: uid is the caller's own outside
        users, become = ["--unshare-user", "--uid", str(uid), "--gid", str(uid)], []
    # /tmp first: a checkout or virtual environment under /tmp (a CI clone's) is bound over it
    args = ["bwrap", *users, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--perms", "1777", "--size", str(256 * 2**20), "--tmpfs", "/tmp", *_read_only(),
            "--proc", "/proc", "--dev", "/dev", *_parents(HOME), "--bind", str(home), HOME]
    for inside, folder in data.items():
        args += [*_parents(f"{HOME}/{inside}", HOME), "--ro-bind", str(folder), f"{HOME}/{inside}"]
    if hide_torch:
        args += _hidden(decoy)
    return args + ["--chdir", HOME, "--", *become]


def check() -> None:
    """Raise SandboxError unless a sandbox starts here (``bwrap``, ``prlimit``, namespaces)."""
    for tool in ("bwrap", "prlimit") + (("setpriv",) if os.geteuid() == 0 else ()):
        if shutil.which(tool) is None:
            raise SandboxError(f"the sandbox needs {tool}, which is not installed "
                               "(apt-get install bubblewrap util-linux)")
    with tempfile.TemporaryDirectory(prefix="gptlab-sandbox-check-") as home:
        command = _bwrap(Path(home), {}, False, Path(home), NOBODY) + [PYTHON, "-c", "pass"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60,
                                  env=_environment())
        except subprocess.TimeoutExpired:
            raise SandboxError("the sandbox did not start within 60 s") from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise SandboxError(f"the sandbox cannot start here: {said}")


def start(home: Path, data: dict[str, Path], program: list[str], pass_fds, stderr, *,
          limits: Limits, hide_torch: bool, uid: int = NOBODY,
          unsafe: bool = False) -> subprocess.Popen:
    """Start ``program`` (arguments after the Python interpreter) for one submission whose
    folder is ``home`` (it becomes HOME, writable; ``data``: name -> folder, read-only beside
    it), as ``uid`` (one per sandbox running at once: the limit on processes counts per user).
    ``pass_fds``: the channel's descriptors; ``stderr``: a file for what the sandbox and the
    runner say on stderr. The caller ends it with :func:`stop`."""
    home.chmod(0o777)  # nobody writes there
    decoy = home.parent / "torch-decoy"
    if hide_torch and not decoy.exists():
        decoy.mkdir(exist_ok=True)
        (decoy / "__init__.py").write_text(DECOY)
    if unsafe:
        for name, folder in data.items():
            (home / name).parent.mkdir(parents=True, exist_ok=True)
            (home / name).symlink_to(folder)
        env = {**_environment(), "HOME": str(home), "MPLCONFIGDIR": str(home / ".matplotlib"),
               "IPYTHONDIR": str(home / ".ipython")}
        command = [*_prlimit(limits), PYTHON, *program]
        return subprocess.Popen(command, cwd=home, env=env, pass_fds=pass_fds,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=stderr, start_new_session=True)
    command = [*_prlimit(limits), *_bwrap(home, data, hide_torch, decoy, uid), PYTHON, *program]
    return subprocess.Popen(command, env=_environment(), pass_fds=pass_fds,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=stderr, start_new_session=True)


def warm(home: Path, *, limits: Limits, unsafe: bool = False) -> None:
    """Fill ``home`` with the caches a submission would build again and again (matplotlib's
    font list), for :func:`copy_warm` to give each submission's home a copy."""
    home.mkdir(exist_ok=True)
    process = start(home, {}, ["-c", WARM], (), subprocess.DEVNULL, limits=limits,
                    hide_torch=False, unsafe=unsafe)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pass
    finally:
        stop(process)


def copy_warm(warmed: Path, home: Path) -> None:
    """A copy of :func:`warm`'s caches in ``home``, writable by the submission."""
    shutil.copytree(warmed, home, dirs_exist_ok=True)
    for folder, _, files in os.walk(home):
        os.chmod(folder, 0o777)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o666)


def stop(process: subprocess.Popen) -> None:
    """End a submission's processes, all of them (its process group; in the sandbox, its PID
    namespace ends with it)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
