"""Building and loading the CPU kernels' C++ sources with torch's ``cpp_extension``, one process at a time.

torch's own guard is a lock file that a build killed midway (SIGKILL, a lost machine) leaves behind, and every later
load then waits for it forever. Here the processes queue on an ``flock``, which the OS releases when its holder dies,
and the holder clears a torch lock file that no live build can own.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path


def cpu_flags_line() -> str:
    """The ``flags`` line of /proc/cpuinfo ("" where there is none)."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


def ensure_ninja() -> None:
    """torch's cpp_extension runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency) installs one into the
    environment's bin folder, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def first_error_line(error: Exception) -> str:
    """The line of a failed build's output that names the error, for a one-line warning."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower()), lines[-1] if lines else type(error).__name__)


def build_and_load(name: str, source: Path, cflags: list[str]) -> None:
    """``cpp_extension.load`` of ``source`` as extension ``name`` into a folder of its own (``name`` must change with
    the source and flags), compiled with OpenMP so that it runs on torch's own pool."""
    from torch.utils import cpp_extension

    ensure_ninja()
    folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "nebula-build.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        cpp_extension.load(name, [str(source)], extra_cflags=[*cflags, "-fopenmp"], extra_ldflags=["-fopenmp"],
                           build_directory=str(folder), is_python_module=False, verbose=False)
