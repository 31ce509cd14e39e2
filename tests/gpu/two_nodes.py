#!/usr/bin/env python3
"""Two "nodes" on one multi-GPU host: a rank dies on node B, node A's daemon names it.

Run by tests/gpu/two_nodes.sh, which makes the network (two namespaces on a bridge) and
cleans it up; this harness starts and stops the processes:

- a real Alertmanager on the bridge's address, grouping JobHangSuspected by
  [alertname, job_id] as deploy/alertmanager/alertmanager.yml does;
- one `gpuwatchd run` per node inside its namespace (`ip netns exec`), its own state
  directory, node name and listen address, sending to that Alertmanager;
- a torch.distributed job of 2*K ranks, K per node (CUDA_VISIBLE_DEVICES: the node's
  half of the GPUs), NCCL over sockets on the node's veth (P2P, SHM, IB and NVLink
  multicast off), NCCL RAS listening on the node's address; every rank all_reduces a
  tensor every ~50 ms.

After --warm seconds of steps the last rank (on node B) is killed with SIGKILL. Daemon
A's /hangs and /alerts and Alertmanager's /api/v2/alerts/groups are then read every
0.5 s until --deadline: A must name the dead rank and node B's address (from RAS) within
--within (30) s, and both daemons' JobHangSuspected alerts must sit in one group.
Writes OUT/result.json and OUT/*.log; exit 0 when both hold, 1 otherwise.

--dry-run: no namespaces, no GPU, no root: both daemons on 127.0.0.1 (their own ports)
with a replayed NVML capture, fake ranks that only sleep; the plumbing only (nothing
can be flagged). Every process started is listed in OUT/pids.txt ("PID STARTTIME NAME")
so the driver's trap can end what is left, and only that.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
REPLAYED_CAPTURE = ROOT / "tests" / "fixtures" / "nvml" / "h200x2-record.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/gpu: its sibling scripts
from cause_kills import wait_for as wait_until  # noqa: E402  (POLL 0.5 s, as here)

POLL = 0.5
RAS_PORT = 28028
ALERTNAME = "JobHangSuspected"
AM_CONFIG = """\
route:
  receiver: default
  group_by: [node, alertname]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
  routes:
    - matchers: ['alertname="JobHangSuspected"']
      group_by: [alertname, job_id]
receivers:
  - name: default
"""
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# the daemons and ranks talk on the bridge and loopback, never through a proxy
LOCAL_ENV = {
    "NO_PROXY": "127.0.0.1,localhost,10.77.0.0/24",
    "no_proxy": "127.0.0.1,localhost,10.77.0.0/24",
}


def get_json(url: str) -> Any:
    with _NO_PROXY.open(url, timeout=3) as r:
        return json.loads(r.read())


# --- a rank -------------------------------------------------------------------------------


def rank_main(run_dir: Path, fake: bool) -> int:
    """all_reduce steadily; DIR/ready-RANK after the first step. Fake: sleep."""
    rank = int(os.environ["RANK"])
    step: Any = lambda: None  # noqa: E731
    if not fake:
        import torch
        import torch.distributed as dist

        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
        x = torch.ones(1 << 20, device=dev)

        def step() -> None:
            dist.all_reduce(x)
            torch.cuda.synchronize()

    n = 0
    while True:
        step()
        n += 1
        if n == 1:
            (run_dir / f"ready-{rank}").touch()
            print(f"rank {rank} stepping (pid {os.getpid()})", flush=True)
        if n % 200 == 0:
            print(f"rank {rank} step {n}", flush=True)
        time.sleep(0.05)


# --- the harness --------------------------------------------------------------------------


class Node:
    """One "node": its namespace (none when dry), address, daemon port and GPUs."""

    def __init__(self, name: str, netns: str, addr: str, ifname: str, port: int, gpus: str):
        self.name, self.netns, self.addr, self.ifname = name, netns, addr, ifname
        self.port, self.gpus = port, gpus
        self.url = f"http://{addr}:{port}"

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *cmd] if self.netns else cmd

    def describe(self) -> dict[str, Any]:
        keys = ("netns", "addr", "ifname", "port", "gpus")
        return {"node": f"node-{self.name}", **{k: getattr(self, k) for k in keys}}


class Procs:
    """The processes this harness started, each listed in OUT/pids.txt."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.list: list[tuple[str, subprocess.Popen[bytes]]] = []
        (out / "pids.txt").write_text("")

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Any:
        with open(self.out / f"{name}.log", "wb") as log:
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:  # the start time tells the trap this pid is still ours
            start = Path(f"/proc/{p.pid}/stat").read_text().rpartition(")")[2].split()[19]
        except (OSError, IndexError):
            start = "?"
        with open(self.out / "pids.txt", "a") as f:
            f.write(f"{p.pid} {start} {name}\n")
        self.list.append((name, p))
        return p

    def stop_all(self) -> dict[str, int | None]:
        """SIGTERM (daemons flush), then SIGKILL what is left; the exit codes by name."""
        for _, p in self.list:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.time() + 20
        for _, p in self.list:
            try:
                p.wait(max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        return {name: p.returncode for name, p in self.list}


def daemon_config(node: Node, state: Path, am_url: str) -> str:
    return (
        f"daemon: {{state_dir: {state}, node_name: node-{node.name}}}\n"
        f"alertmanager: {{urls: ['{am_url}'], resend_interval: 5}}\n"
        "hangs: {stacks: false}\n"
    )


def rank_env(node: Node, rank: int, local: int, k: int, master: tuple[str, int], dry: bool) -> Any:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path, **LOCAL_ENV)
    env.update(
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
        WORLD_SIZE=str(2 * k),
        RANK=str(rank),
        LOCAL_RANK=str(local),
        LOCAL_WORLD_SIZE=str(k),
        NCCL_P2P_DISABLE="1",
        NCCL_SHM_DISABLE="1",
        NCCL_IB_DISABLE="1",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NCCL_RAS_ENABLE="1",
        NCCL_RAS_ADDR=f"{node.addr}:{RAS_PORT}",
    )
    if node.ifname:
        env["NCCL_SOCKET_IFNAME"] = node.ifname
        env["GLOO_SOCKET_IFNAME"] = node.ifname
    if not dry:
        env["CUDA_VISIBLE_DEVICES"] = node.gpus
    return env


def ranks_named(text: str) -> set[int]:
    """Rank numbers a reason names: "rank 3 died", "ranks 2-3, 5", "3:1234" pairs."""
    out: set[int] = set()
    for m in re.finditer(r"\branks? ((?:\d+(?:-\d+)?)(?:, \d+(?:-\d+)?)*)", text):
        for part in m.group(1).split(", "):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def hang_alerts(node: Node) -> list[dict[str, Any]]:
    alerts = get_json(f"{node.url}/alerts").get("alerts", [])
    return [
        a
        for a in alerts
        if a.get("labels", {}).get("alertname") == ALERTNAME and a.get("status") == "firing"
    ]


def am_groups(am_url: str) -> list[dict[str, Any]]:
    """Alertmanager's JobHangSuspected groups: their labels and each alert's node, job."""
    out = []
    for g in get_json(f"{am_url}/api/v2/alerts/groups"):
        if g.get("labels", {}).get("alertname") != ALERTNAME:
            continue
        alerts = [
            {k: a.get("labels", {}).get(k) for k in ("node", "job_id", "severity", "role")}
            for a in g.get("alerts", [])
        ]
        out.append({"labels": g.get("labels", {}), "alerts": alerts})
    return out


def one_incident(groups: list[dict[str, Any]], nodes: set[str]) -> bool:
    return any(nodes <= {a["node"] for a in g["alerts"]} for g in groups)


WATCHED = (
    "seconds_to_verdict",
    "seconds_to_alert",
    "seconds_to_named",
    "seconds_to_group",
    "hang_id",
    "reason",
    "nodes_named",
    "ras_error",
    "alert_reason",
    "names_victim_rank",
    "names_node_b",
    "remote_named_in_time",
    "daemon_a_ranks",
    "groups",
    "grouped",
)


def poll_after_kill(
    args: argparse.Namespace, a: Node, b: Node, am_url: str, victim: int, before: set[Any]
) -> dict[str, Any]:
    """Daemon A's /hangs and /alerts and Alertmanager's groups every POLL s after the kill
    (at `args.killed_at`), until A names the rank and node B and the alerts group."""
    t0 = args.killed_at
    out: dict[str, Any] = dict.fromkeys(WATCHED)
    out.update(reason="", alert_reason="", nodes_named=[], groups=[], grouped=False)
    nodes = {f"node-{a.name}", f"node-{b.name}"}
    while time.time() < t0 + args.deadline:
        now = round(time.time() - t0, 1)
        try:
            docs = get_json(f"{a.url}/hangs").get("hangs", [])
            doc = next((d for d in docs if d.get("id") not in before), None)
            if doc is not None:
                full = get_json(f"{a.url}/hangs?id={doc['id']}")
                if out["hang_id"] is None:
                    out.update(hang_id=doc["id"], seconds_to_verdict=now)
                out.update(reason=str(full.get("reason", "")), nodes_named=full.get("nodes", []))
                out["ras_error"] = (full.get("ras") or {}).get("error")
                out["daemon_a_ranks"] = [
                    {"rank": r.get("rank"), "pid": r.get("pid")} for r in full.get("ranks", [])
                ]
            alerts = hang_alerts(a)
            if alerts:
                if out["seconds_to_alert"] is None:
                    out["seconds_to_alert"] = now
                out["alert_reason"] = str(alerts[0].get("annotations", {}).get("description", ""))
            text = f"{out['reason']} {out['alert_reason']}"
            out["names_victim_rank"] = victim in ranks_named(text)
            out["names_node_b"] = b.addr in text or b.addr in out["nodes_named"]
            if out["names_victim_rank"] and out["names_node_b"] and not out["seconds_to_named"]:
                out["seconds_to_named"] = now
        except (OSError, ValueError, KeyError, StopIteration) as exc:
            out["last_daemon_error"] = f"{type(exc).__name__}: {exc}"
        try:
            out["groups"] = am_groups(am_url)
            out["grouped"] = one_incident(out["groups"], nodes)
            if out["grouped"] and out["seconds_to_group"] is None:
                out["seconds_to_group"] = now
        except (OSError, ValueError) as exc:
            out["last_alertmanager_error"] = f"{type(exc).__name__}: {exc}"
        if out["seconds_to_named"] is not None and out["grouped"]:
            break
        time.sleep(POLL)
    named = out["seconds_to_named"]
    out["remote_named_in_time"] = named is not None and named <= args.within
    return out


def start_alertmanager(procs: Procs, out: Path, addr: str, port: int) -> str:
    binary = os.environ.get("ALERTMANAGER") or shutil.which("prometheus-alertmanager")
    binary = binary or shutil.which("alertmanager")
    if not binary:
        raise RuntimeError("no alertmanager (Debian prometheus-alertmanager, or ALERTMANAGER=)")
    work = out / "alertmanager"
    work.mkdir(exist_ok=True)
    (work / "alertmanager.yml").write_text(AM_CONFIG)
    cmd = [binary, f"--config.file={work / 'alertmanager.yml'}"]
    cmd += [f"--storage.path={work / 'data'}", f"--web.listen-address={addr}:{port}"]
    cmd += ["--cluster.listen-address=", "--log.level=warn"]
    procs.start("alertmanager", cmd)
    url = f"http://{addr}:{port}"
    if not wait_until(time.time() + 20, lambda: _NO_PROXY.open(f"{url}/-/ready", timeout=2)):
        raise RuntimeError(f"alertmanager did not answer on {url} within 20 s")
    return url


def reach(node: Node, url: str) -> str:
    """'ok' when `url` answers from inside the node's namespace, else why not."""
    probe = f"import urllib.request as u; u.urlopen({url!r}, timeout=3).close()"
    done = subprocess.run(
        node.wrap([sys.executable, "-c", probe]),
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, **LOCAL_ENV),
    )
    return "ok" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


def run(args: argparse.Namespace, out: Path, procs: Procs, result: dict[str, Any]) -> None:
    k = args.ranks_per_node
    half_a, half_b = args.gpus_a or "0", args.gpus_b or "1"
    a = Node("a", args.netns_a, args.addr_a, args.ifname_a, args.daemon_port_a, half_a)
    b = Node("b", args.netns_b, args.addr_b, args.ifname_b, args.daemon_port_b, half_b)
    result["nodes"] = {"a": a.describe(), "b": b.describe()}
    result["world_size"] = 2 * k
    am_url = start_alertmanager(procs, out, args.am_addr, args.am_port)
    result["alertmanager_url"] = am_url
    for node in (a, b):
        state = out / f"state-{node.name}"
        cfg = out / f"daemon-{node.name}.yaml"
        cfg.write_text(daemon_config(node, state, am_url))
        cmd = [sys.executable, "-m", "gpuwatchd", "run", "--config", str(cfg)]
        cmd += ["--listen", f"{node.addr}:{node.port}"]
        if args.dry_run:
            cmd += ["--nvml-replay", str(REPLAYED_CAPTURE)]
        procs.start(f"daemon-{node.name}", node.wrap(cmd), dict(os.environ, **LOCAL_ENV))
    for node in (a, b):
        if not wait_until(
            time.time() + 60, lambda n=node: _NO_PROXY.open(f"{n.url}/healthz", timeout=2)
        ):
            raise RuntimeError(f"daemon {node.name} did not answer on {node.url} within 60 s")
    # across the bridge, as the job and the alerts will go (a host firewall can drop it)
    result["network"] = {
        "a -> b daemon": reach(a, f"{b.url}/healthz"),
        "b -> a daemon": reach(b, f"{a.url}/healthz"),
        "a -> alertmanager": reach(a, f"{am_url}/-/ready"),
        "b -> alertmanager": reach(b, f"{am_url}/-/ready"),
    }
    if any(v != "ok" for v in result["network"].values()):
        raise RuntimeError(f"the nodes cannot reach each other: {result['network']}")
    run_dir = out / "run"
    run_dir.mkdir(exist_ok=True)
    master = (a.addr, args.master_port)
    ranks: dict[int, Any] = {}
    for rank in range(2 * k):
        node, local = (a, rank) if rank < k else (b, rank - k)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--rank", str(run_dir)]
        cmd += ["--dry-run"] if args.dry_run else []
        env = rank_env(node, rank, local, k, master, args.dry_run)
        ranks[rank] = procs.start(f"rank{rank}", node.wrap(cmd), env)
    result["ranks"] = {r: p.pid for r, p in ranks.items()}
    ready = wait_until(
        time.time() + args.start_timeout,
        lambda: all((run_dir / f"ready-{r}").exists() for r in ranks),
    )
    if not ready:
        raise RuntimeError(f"the ranks did not step within {args.start_timeout} s")
    time.sleep(args.warm)
    before = {d.get("id") for d in get_json(f"{a.url}/hangs").get("hangs", [])}
    result["hangs_before_kill"] = len(before)
    victim = 2 * k - 1  # node B's last rank: with K > 1 its first keeps B's RAS listener
    args.killed_at = time.time()
    os.kill(ranks[victim].pid, signal.SIGKILL)
    ranks[victim].wait(10)
    result["victim"] = {"rank": victim, "pid": ranks[victim].pid, "node": f"node-{b.name}"}
    result["victim"]["exit"] = ranks[victim].returncode
    result["killed_at"] = args.killed_at
    result.update(poll_after_kill(args, a, b, am_url, victim, before))
    b_pids = {ranks[r].pid for r in range(k, 2 * k)}  # no GPU filter: A may list B's ranks
    result["daemon_a_sees_b_ranks"] = any(
        r["pid"] in b_pids for r in result["daemon_a_ranks"] or []
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("out", nargs="?", help="result.json and the logs go here")
    ap.add_argument("--dry-run", action="store_true", help="fake ranks, replayed NVML, loopback")
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--gpus-a", default="", help="CUDA_VISIBLE_DEVICES of node A's ranks")
    ap.add_argument("--gpus-b", default="", help="CUDA_VISIBLE_DEVICES of node B's ranks")
    ap.add_argument("--netns-a", default="")
    ap.add_argument("--netns-b", default="")
    ap.add_argument("--addr-a", default="127.0.0.1")
    ap.add_argument("--addr-b", default="127.0.0.1")
    ap.add_argument("--ifname-a", default="")
    ap.add_argument("--ifname-b", default="")
    ap.add_argument("--am-addr", default="127.0.0.1")
    ap.add_argument("--am-port", type=int, default=0)
    ap.add_argument("--daemon-port-a", type=int, default=0)
    ap.add_argument("--daemon-port-b", type=int, default=0)
    ap.add_argument("--master-port", type=int, default=0)
    ap.add_argument("--warm", type=float, default=20.0, help="seconds of steps before the kill")
    ap.add_argument("--within", type=float, default=30.0, help="pass: named by then")
    ap.add_argument("--deadline", type=float, default=60.0, help="poll this long after the kill")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--rank", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        return rank_main(Path(args.rank), args.dry_run)
    if not args.out:
        ap.error("OUT is required")
    from socket import socket

    def free() -> int:
        with socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    for key in ("am_port", "daemon_port_a", "daemon_port_b", "master_port"):
        if not getattr(args, key):
            setattr(args, key, free())
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dry_run": args.dry_run,
        "error": None,
        **dict.fromkeys(WATCHED),
        "victim": None,
        "daemon_a_sees_b_ranks": None,
    }
    started = time.time()
    procs = Procs(out)
    try:
        run(args, out, procs, result)
    except Exception as exc:  # reported in result.json; the processes still end below
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        result["exits"] = procs.stop_all()
    result["ok"] = bool(result["remote_named_in_time"] and result["grouped"])
    result["seconds"] = round(time.time() - started, 1)
    text = json.dumps(result, indent=1, default=str)
    (out / "result.json").write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
