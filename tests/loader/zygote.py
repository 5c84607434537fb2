"""Training programs as fresh as `python -c CODE ARGS...`, without paying torch's import each time.

A fresh interpreter that imports torch and the loader costs ~4 CPU-seconds. The zygote is one such
interpreter, started once per pytest worker (the `programs` fixture): it imports them, then forks a
child per program. The child takes the test's pipes as its stdin, stdout and stderr, runs CODE as
`__main__` with sys.argv ["-c", *ARGS], and exits through the interpreter's normal exit (atexit
handlers, non-daemon threads joined) or dies as the test makes it, exactly as a program would. The
zygote itself never builds a loader, so a child starts its own resource tracker as a fresh program
does, and the segments a killed child leaves are that tracker's to unlink.

Protocol on a Unix socket: the test sends {"code", "args"} with the three pipe ends (SCM_RIGHTS);
the zygote answers {"pid"}, and {"pid", "status"} when that child ends (status as Popen's returncode).
"""

from __future__ import annotations

import io
import json
import os
import select
import socket
import subprocess
import sys
import time
import types

MAX_MESSAGE = 1 << 20


def run_child(code: str, args: list[str], fds: list[int]) -> int:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # as a fresh interpreter sets them up: stdout block-buffered to a pipe, stderr line-buffered
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)))
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), line_buffering=True, errors="backslashreplace"
    )
    sys.argv = ["-c", *args]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def serve(sock: socket.socket) -> None:
    children: set[int] = set()
    parent = os.getppid()
    while os.getppid() == parent:  # the test process is gone: so is the zygote
        ready, _, _ = select.select([sock], [], [], 0.05)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                sock.sendall(json.dumps({"pid": pid, "status": code}).encode() + b"\n")
        if not ready:
            continue
        message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
        if not message:
            return  # the test session ended
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            # SystemExit from here on ends the child's interpreter as any program's end does
            raise SystemExit(run_child(request["code"], request["args"], fds))
        for fd in fds:
            os.close(fd)
        children.add(pid)
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")


class Program:
    """A zygote child, as subprocess.Popen shows a process: pid, stdin/stdout/stderr (text), wait,
    send_signal, returncode."""

    def __init__(self, zygote: Zygote, pid: int, stdin, stdout, stderr):
        self.zygote, self.pid = zygote, pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.status(self.pid, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """The rest of stdout and stderr, once the program has ended (its output fits the pipes)."""
        self.stdin.close()
        self.wait(timeout)
        return self.stdout.read(), self.stderr.read()

    def close(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass
            self.wait(30)
        for stream in (self.stdin, self.stdout, self.stderr):
            stream.close()


class Zygote:
    """The test's side: starts the zygote process, and programs in it."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.loader.zygote", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self.buffer = b""
        self.statuses: dict[int, int] = {}

    def _message(self, timeout: float | None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.sock], [], [], left)
            if not ready:
                raise TimeoutError(f"no word from the zygote within {timeout} s")
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("the zygote process ended")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def start(self, code: str, *args: str) -> Program:
        """`python -c CODE ARGS...` with pipes on its stdin, stdout and stderr."""
        pipes = [os.pipe() for _ in range(3)]
        child_ends = [pipes[0][0], pipes[1][1], pipes[2][1]]
        socket.send_fds(self.sock, [json.dumps({"code": code, "args": list(args)}).encode()], child_ends)
        for fd in child_ends:
            os.close(fd)
        stdin = open(pipes[0][1], "w")
        stdout, stderr = open(pipes[1][0]), open(pipes[2][0])
        while True:
            message = self._message(60)
            if "status" in message:
                self.statuses[message["pid"]] = message["status"]
            else:
                return Program(self, message["pid"], stdin, stdout, stderr)

    def status(self, pid: int, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.statuses:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                message = self._message(left)
            except TimeoutError:
                raise subprocess.TimeoutExpired(f"program {pid}", timeout) from None
            if "status" in message:
                self.statuses[message["pid"]] = message["status"]
        return self.statuses.pop(pid)

    def close(self) -> None:
        # shutdown, not only close: loader workers forked from the test process hold copies of the socket
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.process.wait(timeout=30)


if __name__ == "__main__":
    # what the programs import, once: torch, numpy and the loader (none of them starts a process)
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.utils.data  # noqa: F401

    import loader.dataloader  # noqa: F401
    import loader.file_dataset  # noqa: F401

    serve(socket.socket(fileno=int(sys.argv[1])))
