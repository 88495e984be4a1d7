"""Does one huge request stall the others? Measured on `python -m nanovllm_edu.serve` (read by notebooks/24_deployment.ipynb).

The server runs as a subprocess pinned to two cores (`taskset -c 0,1`) on the shipped tiny model. For each body (a
20 MB completion request, sent once with a Content-Length and once chunked; and a 10 MB one, under the
cap, which is parsed and tokenized before its refusal; each to a fresh server) this starts a
long streamed completion, waits until it streams, then sends the body over a raw socket while /health is polled
every 50 ms, and records: the stream's largest gap between chunks during the upload, /health's slowest answer
during it, the status of the reply to the body and how long it took, and the server's resident memory
(/proc/PID/status VmRSS) before the upload and once the stream is done.

    python scripts/serve_stall.py                        # this checkout's server: the record's "after"
    PYTHONPATH=/work/old python scripts/serve_stall.py --as before   # another checkout's server: "before"

Each run rewrites its own key of figures/serve_stall_cpu.json and keeps the other.
"""
import argparse
import json
import os
import platform
import re
import select
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "figures" / "serve_stall_cpu.json"
BODY_BYTES = 20_000_000
UNDER_CAP_BYTES = 10_000_000  # under the server's 10 MiB cap: read, parsed and tokenized, then refused (400)
POLL_SECONDS = 0.05
AFTER_SECONDS = 1.0  # the gaps and polls are read during the upload and this long after it
TARGETS = {"stream_max_gap_s": 0.5, "health_max_s": 0.5, "refusal_s": 5.0, "rss_growth_mb": 100}


def big_body(size: int = BODY_BYTES) -> bytes:
    """A completion request of exactly `size` bytes: a prompt of words no context holds."""
    head, tail = b'{"model": "tiny-qwen3", "max_tokens": 1, "prompt": "', b'"}'
    words = b"hello world " * (size // 12 + 1)
    return head + words[:size - len(head) - len(tail)] + tail


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def start_server(cores: str, package_root: Path) -> tuple[subprocess.Popen, str]:
    """The server pinned to `cores`, and its URL once its readiness line says it listens. It runs in
    `package_root` (`python -m` puts the working folder ahead of PYTHONPATH)."""
    command = ["taskset", "-c", cores, sys.executable, "-m", "nanovllm_edu.serve", "--port", "0", "--device", "cpu",
               "--num-kvcache-blocks", "256", "--kvcache-block-size", "16", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=package_root,
                               env=os.environ | {"PYTHONUNBUFFERED": "1"})
    if not select.select([process.stdout], [], [], 180)[0]:
        process.kill()
        raise RuntimeError("the server did not start within 180 s")
    line = process.stdout.readline().strip()
    if not line.startswith("serving "):
        process.kill()
        raise RuntimeError(f"unexpected first line from the server: {line!r}")
    return process, line.split()[-1]


def follow_stream(url: str, arrivals: list[float], started: threading.Event) -> None:
    """A long streamed completion; the arrival time of each chunk goes into `arrivals`."""
    body = {"model": "tiny-qwen3", "prompt": "Return the", "max_tokens": 2000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
                if len(arrivals) == 20:
                    started.set()


def poll_health(url: str, polls: list[tuple[float, float]], stop: threading.Event) -> None:
    """GET /health every POLL_SECONDS until `stop`; each poll's (sent, answered) times go into `polls`."""
    with httpx.Client(timeout=300) as client:
        while not stop.is_set():
            sent = time.monotonic()
            client.get(url + "/health")
            polls.append((sent, time.monotonic()))
            stop.wait(POLL_SECONDS)


def upload(url: str, body: bytes, chunked: bool) -> dict:
    """POST `body` over a raw socket (with a Content-Length, or chunked) while a thread reads the reply: a server
    may answer before the body is sent. Returns the reply's status, when it came and when the upload began."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {len(body)}\r\n\r\n"
    reply = {"data": b""}

    def read() -> None:
        while b"\r\n\r\n" not in reply["data"]:
            try:
                piece = sock.recv(65536)
            except OSError as err:
                reply["recv_error"] = repr(err)
                return
            if not piece:
                return
            reply["data"] += piece
        reply["answered"] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    began = finished = time.monotonic()
    try:
        sock.sendall(head.encode())
        for i in range(0, len(body), 65536):
            piece = body[i:i + 65536]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
    except OSError as err:  # the server closed the connection once it had answered
        reply["send_error"] = repr(err)
    finished = time.monotonic()
    reader.join(300)
    sock.close()
    status = re.match(rb"HTTP/1\.1 (\d+)", reply["data"])
    return {"began": began, "finished": finished, "answered": reply.get("answered"),
            "status": int(status.group(1)) if status else None, "send_error": reply.get("send_error")}


def measure(body: bytes, chunked: bool, cores: str, package_root: Path) -> dict:
    """One body against a fresh server, with a stream running and /health polled."""
    process, url = start_server(cores, package_root)
    try:
        httpx.post(url + "/v1/completions", json={"prompt": "Return the", "max_tokens": 8}, timeout=60)  # warm up
        arrivals, polls, started, stop = [], [], threading.Event(), threading.Event()
        streamer = threading.Thread(target=follow_stream, args=(url, arrivals, started), daemon=True)
        streamer.start()
        if not started.wait(60):
            raise RuntimeError("the stream did not start")
        rss_before = rss_mb(process.pid)
        poller = threading.Thread(target=poll_health, args=(url, polls, stop), daemon=True)
        poller.start()
        time.sleep(0.5)  # a few polls before the upload
        sent = upload(url, body, chunked)
        answered = sent["answered"] or time.monotonic()
        end = max(answered, sent["finished"])  # the upload: until the reply came and the last byte was sent
        time.sleep(AFTER_SECONDS + 0.5)
        stop.set()
        poller.join(300)
        streamer.join(300)
        time.sleep(2)  # let the server settle before reading its memory
        rss_after = rss_mb(process.pid)
        began = sent["began"]
        until = end + AFTER_SECONDS
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= began and a <= until]  # overlapping it
        waits = [done - asked for asked, done in polls if done >= began and asked <= until]
        return {"status": sent["status"], "refusal_s": round(answered - began, 3),
                "upload_s": round(end - began, 3),
                "stream_max_gap_s": round(max(gaps, default=0.0), 3), "stream_chunks": len(arrivals),
                "health_max_s": round(max(waits), 3) if waits else None, "health_polls": len(waits),
                "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_after, 1),
                "rss_growth_mb": round(rss_after - rss_before, 1), "client_send_error": sent["send_error"]}
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def commit_of(package_root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(package_root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--as", dest="key", default="after", choices=["after", "before"],
                    help="which key of the record this run writes (default: after)")
    ap.add_argument("--cores", default="0,1", help="the cores the server is pinned to (default 0,1)")
    ap.add_argument("--out", type=Path, default=RECORD)
    args = ap.parse_args()
    import nanovllm_edu  # the package the server will run: PYTHONPATH decides, as for the subprocess
    package_root = Path(nanovllm_edu.__file__).resolve().parents[1]
    body = big_body()
    run = {"commit": commit_of(package_root), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
           "content_length": measure(body, chunked=False, cores=args.cores, package_root=package_root),
           "chunked": measure(body, chunked=True, cores=args.cores, package_root=package_root),
           "under_cap": measure(big_body(UNDER_CAP_BYTES), chunked=False, cores=args.cores,
                                package_root=package_root)}
    record = json.loads(args.out.read_text()) if args.out.exists() else {}
    record |= {"about": "scripts/serve_stall.py: a 20 MB completion request sent to python -m nanovllm_edu.serve "
               "(tiny model, pinned to two cores) while a 2000-token stream runs and /health is polled every "
               "50 ms; once with a Content-Length, once chunked, each to a fresh server; under_cap: a 10,000,000-byte body, "
               "under the cap, read, parsed and tokenized before its 400. refusal_s: until the reply's status "
               "line; upload_s: until that and the body's last byte sent; the stream's gaps and the /health polls are "
               "those overlapping the upload and the second after it. before: the server "
               "without a body limit, parsing and tokenizing on its event loop; after: this course's.",
               "body_bytes": len(body), "cores": len(args.cores.split(",")), "machine_cpus": os.cpu_count(),
               "machine": platform.machine(), "targets": TARGETS, args.key: run}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({args.key: run}, indent=1))


if __name__ == "__main__":
    main()
