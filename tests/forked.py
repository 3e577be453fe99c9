"""A fork server for the tests' worker processes: importing sentence-transformers costs 6-9 s of CPU per process,
which dominated every test that starts a worker (a torchrun rank, a trainer run to SIGKILL). The server imports the
heavy modules once; each worker is a child forked from it, a real process of its own (its own pid, SIGKILL-able,
its own gloo connections), that runs ``python -m MODULE ARGS`` (:func:`runpy.run_module`) or ``python -c CODE`` from
that already-imported state. The server runs no torch op before forking (no thread pool to inherit).

Run by :class:`ForkServer` as ``python -m tests.forked PRELOAD...``; it reads one JSON command a line on stdin:

- ``{"start": {"module" | "code": ..., "argv": [...], "env": {...}, "log": PATH, "cwd": PATH, "isolate": bool}}``:
  fork a worker (stdout and stderr to ``log``); answers ``{"pid": PID}``;
- ``{"poll": PID}``: ``{"returncode": CODE or null}`` (null while it runs; -N: killed by signal N);
- ``{"wait": PID, "timeout": S}``: ``{"returncode": CODE}``, killing it (SIGKILL) after ``timeout`` seconds.

On the end of stdin it kills the workers still running and exits.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _child(spec: dict) -> None:
    """In the forked worker: set it up as a fresh ``python -m`` / ``python -c`` would be, run it, exit."""
    code = 1
    try:
        log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ.update(spec.get("env", {}))
        if spec.get("cwd"):
            os.chdir(spec["cwd"])
        if spec.get("isolate"):
            # As a process started outside this checkout: neither the repository root nor the tests importable.
            sys.path[:] = [p for p in sys.path if p not in ("", ".", str(REPO_ROOT))]
            for name in [n for n in sys.modules if n == "tests" or n.startswith("tests.")]:
                del sys.modules[name]
        import runpy

        if "module" in spec:
            sys.argv = [spec["module"], *spec.get("argv", [])]
            runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *spec.get("argv", [])]
            exec(compile(spec["code"], "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(preload: list[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    children: dict[int, int | None] = {}

    def reap(pid: int, block: bool) -> int | None:
        if children.get(pid) is None:
            done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            if done:
                children[pid] = _returncode(status)
        return children[pid]

    out = sys.stdout
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        command = json.loads(line)
        if "start" in command:
            pid = os.fork()
            if pid == 0:
                _child(command["start"])
            children[pid] = None
            answer = {"pid": pid}
        elif "poll" in command:
            answer = {"returncode": reap(command["poll"], block=False)}
        else:
            pid, deadline = command["wait"], time.monotonic() + command["timeout"]
            while reap(pid, block=False) is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if children[pid] is None:
                os.kill(pid, signal.SIGKILL)
            answer = {"returncode": reap(pid, block=True)}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    for pid, code in children.items():
        if code is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown of the imported libraries (a second or two)


# The modules the workers import: sentence-transformers, its trainer, datasets and the package.
PRELOAD = (
    "torch",
    "torch.distributed",
    "sentence_transformers",
    "datasets",
    "transformers",
    "st_weince.losses",
    "st_weince.training",
)


class ForkServer:
    """The pytest side: starts the server (one import of :data:`PRELOAD` for every worker of the session)."""

    def __init__(self, log: Path, preload=PRELOAD) -> None:
        """``log``: the server's own stderr (import warnings, a crash)."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
        self.log = Path(log)
        with open(self.log, "w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.forked", *preload],
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        ready = self.process.stdout.readline()
        if not ready:
            raise RuntimeError(f"the fork server did not start (exit {self.process.wait()}): {self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def _ask(self, command: dict) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the fork server ended (exit {self.process.wait()}): {self._log_tail()}")
        return json.loads(answer)

    def start(self, log: Path, *, module: str | None = None, code: str | None = None, argv=(), env=None, **extra):
        """Fork a worker running ``module`` (as ``python -m``) or ``code`` (as ``python -c``); returns a
        :class:`Worker`. ``env``: added to the environment; ``cwd``; ``isolate=True``: the repository root and the
        tests are not importable (as for a process started elsewhere)."""
        extra = {key: str(value) if isinstance(value, Path) else value for key, value in extra.items()}
        spec = {"argv": [str(a) for a in argv], "env": dict(env or {}), "log": str(log), **extra}
        spec.update({"module": module} if module is not None else {"code": code})
        return Worker(self, self._ask({"start": spec})["pid"], Path(log))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)
        self.process.stdout.close()


class Worker:
    def __init__(self, server: ForkServer, pid: int, log: Path) -> None:
        self.server, self.pid, self.log = server, pid, log

    def poll(self) -> int | None:
        return self.server._ask({"poll": self.pid})["returncode"]

    def wait(self, timeout: float = 600) -> int:
        """The exit status (negative: killed by that signal), killing the worker after ``timeout`` seconds."""
        return self.server._ask({"wait": self.pid, "timeout": timeout})["returncode"]

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def run_ranks(server: ForkServer, module: str, argv, log_dir: Path, nproc: int = 2, timeout: float = 600) -> str:
    """``torchrun --nproc_per_node nproc -m module argv`` on one machine: ``nproc`` forked workers with torchrun's
    environment (RANK, WORLD_SIZE, LOCAL_RANK, ..., MASTER_ADDR/PORT on a free loopback port). Raises with the
    workers' output if one fails (the others are killed). Returns the output of rank 0. torchrun's own agent
    (restarts, its rendezvous store) is not involved: tests/recipes/test_simcse_recipe.py runs the recipe under
    torchrun."""
    from tests.conftest import free_port

    port = free_port()
    workers = []
    for rank in range(nproc):
        env = {
            "RANK": rank,
            "LOCAL_RANK": rank,
            "GROUP_RANK": 0,
            "ROLE_RANK": rank,
            "ROLE_NAME": "default",
            "WORLD_SIZE": nproc,
            "LOCAL_WORLD_SIZE": nproc,
            "ROLE_WORLD_SIZE": nproc,
            "GROUP_WORLD_SIZE": 1,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "TORCHELASTIC_RESTART_COUNT": 0,
            "TORCHELASTIC_MAX_RESTARTS": 0,
            "TORCHELASTIC_RUN_ID": "none",
            "OMP_NUM_THREADS": 1,
        }
        log = log_dir / f"{module.rsplit('.', 1)[-1]}-{nproc}-rank{rank}.log"
        workers.append(server.start(log, module=module, argv=argv, env={k: str(v) for k, v in env.items()}))
    deadline = time.monotonic() + timeout
    codes = [None] * nproc
    while None in codes:
        for rank, worker in enumerate(workers):
            if codes[rank] is None:
                codes[rank] = worker.poll()
        failed = any(code not in (None, 0) for code in codes)
        if failed or time.monotonic() > deadline:
            for worker in workers:
                worker.kill()
            codes = [worker.wait(timeout=30) for worker in workers]
            logs = "\n".join(
                f"--- rank {r} (exit {c}) ---\n{w.output()[-3000:]}" for r, (w, c) in enumerate(zip(workers, codes))
            )
            raise AssertionError(f"{module} with {nproc} processes failed:\n{logs}")
        if None in codes:
            time.sleep(0.05)
    return workers[0].output()


if __name__ == "__main__":
    serve(sys.argv[1:])
