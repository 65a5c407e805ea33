"""What the network lab's links give: TCP round trip and bulk throughput between two hosts.

    python benchmarks/lab_links.py                     # every lab setting, 3 repetitions (root)
    python benchmarks/lab_links.py --links 100mbit+20ms --reps 1

For each link (a rate, or a rate and an added round trip, as benchmarks/_spawn.LINK_SETTINGS
names them) it brings up two lab hosts, times 21 one-byte TCP round trips (median) and sends
``--megabytes`` over one TCP connection, host 0 to host 1; ``--reps`` times.  Prints a table
and writes JSON: what the rates and delays the other benchmarks use really are.
"""
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _spawn  # noqa: E402
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

LINKS = ["1gbit", "100mbit", "1gbit+20ms", "100mbit+20ms", "10mbit+100ms"]
PORT = 5601

SERVER = f"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT})); s.listen(2); print("listening", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    d = c.recv(64)
    if not d: break
    c.sendall(d)
c, _ = s.accept(); n = 0
while True:
    d = c.recv(1 << 20)
    if not d: break
    n += len(d)
c.sendall(str(n).encode())
"""

CLIENT = f"""
import json, socket, sys, time
host, megabytes = sys.argv[1], int(sys.argv[2])
c = socket.create_connection((host, {PORT}), timeout=60)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(21):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(64); rtts.append(time.perf_counter() - t)
c.close()
c = socket.create_connection((host, {PORT}), timeout=120)
chunk = bytes(1 << 20); t = time.perf_counter()
for _ in range(megabytes):
    c.sendall(chunk)
c.shutdown(socket.SHUT_WR); received = int(c.recv(64)); seconds = time.perf_counter() - t
print(json.dumps({{"rtt_ms": sorted(rtts)[10] * 1000, "mbit_s": received * 8 / seconds / 1e6}}))
"""


def measure(megabytes, hosts=("nl-0", "nl-1"), address="10.200.0.2"):
    """Round trip and throughput from lab host ``hosts[0]`` to ``hosts[1]`` (at ``address``),
    once: {"rtt_ms", "mbit_s"}."""
    server = subprocess.Popen(["ip", "netns", "exec", hosts[1], sys.executable, "-c", SERVER],
                              stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "listening":
            raise RuntimeError("the lab's server did not start")
        out = subprocess.run(["ip", "netns", "exec", hosts[0], sys.executable, "-c", CLIENT,
                              address, str(megabytes)],
                             check=True, timeout=600, capture_output=True, text=True).stdout
        return json.loads(out)
    finally:
        server.kill()
        server.wait()


def megabytes_for(link):
    """About 5 s of the link's rate, at least 4 MiB."""
    rate = link.split("+")[0]
    mbit = float(rate[:-4]) * (1000 if rate.endswith("gbit") else 1)
    return max(4, int(mbit * 5 / 8))


def main():
    p = _spawn.parser(__doc__, "lab_links.json")
    p.add_argument("--links", default=",".join(LINKS))
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    links = args.links.split(",")
    rows = []
    for link in links:
        with _spawn.lab(2, link):
            samples = [measure(megabytes_for(link)) for _ in range(args.reps)]
        rows.append({"link": link, "samples": samples,
                     "rtt_ms": statistics.median(s["rtt_ms"] for s in samples),
                     "mbit_s": statistics.median(s["mbit_s"] for s in samples)})
        print(f"{link:>14}: round trip {rows[-1]['rtt_ms']:7.2f} ms "
              f"({', '.join('%.2f' % s['rtt_ms'] for s in samples)}), "
              f"{rows[-1]['mbit_s']:7.1f} Mbit/s "
              f"({', '.join('%.1f' % s['mbit_s'] for s in samples)})", flush=True)
    report = dict(_spawn.provenance(), benchmark="lab_links", reps=args.reps, links=rows,
                  when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
