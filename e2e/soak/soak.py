#!/usr/bin/env python3
"""An adversarial soak of Bulkhead with real processes (issue 18).

It starts, all on loopback and in one temp dir: its own PostgreSQL and Redis (never the
machine's shared ones), two control-plane replicas (`bulkhead serve`, each its own data dir,
both on that PostgreSQL and Redis, serving no model themselves), a prefill and a decode node
(disaggregated; the KV transfer link runs through a TCP proxy in this script) and a unified
node serving the text and the embedding model. Every node heartbeats to both replicas. Then
it creates 20 tenants, each with a secret canary word, deploys a JS worker (worker.js here,
calling env.AI.run) for a few of them, and sends a bounded number of requests from a thread
pool, through a client-side load balancer that only picks replicas the fault schedule has
not taken down:

- unservable prompts: over the prefill pool, over the context window, exactly at the window
  (servable) and one token past it; Workers AI, OpenAI and through a worker's AI.run;
  streamed and not. Any 2xx for an unservable one is counted (`unservable_2xx`);
- canary prompts: a tenant's own secret code repeated; every answer (success or error) is
  checked for every OTHER tenant's secret word (`foreign_canaries`);
- OpenAI chat completions (`/v1/...` and `/client/v4/accounts/{id}/ai/v1/...`), Workers AI
  `ai/run`, embeddings on both APIs, a worker's AI.run (text, stream, embeddings).

Meanwhile a fault schedule, scaled to the request count (one cycle of seven faults per 2,000
requests), does: kill -9 and restart the unified node; put the KV transfer proxy into
corrupt (flipped bytes), stall and disconnect modes, each for a while; kill -9 and restart
one replica (alternating; the other serves everything meanwhile); stop PostgreSQL
(immediate shutdown) for 10 s and start it again; kill -9 Redis and start it again. The last
~20% of each cycle has no fault.

At the end (everything up again, usage flushed) it checks that every node's KV pool is whole
(`pages_not_returned`), that no isolation alarm went off on any node or replica
(`isolation_alarms`), that per tenant the answered successes (2xx, or a stream that ended in
[DONE]) <= the successes in `GET /admin/v1/usage` (requests minus errors) <= answered +
in-doubt (`usage_lost`, `usage_overcounted`), and classifies every 5xx and stream error
event by code: outside a fault window (its start to its end plus 15 s, three heartbeat
timeouts) it is `unexplained_5xx`. A request is in doubt when its replica was killed while
it was in flight (or its connection broke). Also counted, and required to be 0: `bad_2xx`
(a 2xx whose body is not a well-formed answer), `unclean_errors` (a 5xx without an error
code, a 500 (faults are 502/503), a connection that broke or a stream that stopped without [DONE] or an error event on
a replica that was not killed), `servable_refused` (a 4xx other than 429 for a request
that fits) and `own_canary_missing` (a 2xx for a tenant's canary prompt without its code:
each code is vetted first, one the model copies when asked alone, greedy, so a 2xx without
it is a wrong answer, e.g. from corrupted KV that was used).

It prints ONE line of counters on stdout and exits 1 when any must-be-zero counter is not 0
(2 when it could not run at all, 130 when interrupted); the findings behind a non-zero
counter go to stderr first. In `5xx_by_cause` a key is `status/code` (the envelope's code:
Workers AI numbers, OpenAI strings, the worker's AI error), `stream/code` for a stream's
error event, `replica_killed` for a request in flight on a replica when it was killed.
The temp dir (`--keep`) holds every process's log, requests.jsonl (one line a request:
kind, tenant, replica, times, status, a snippet) and faults.jsonl (each fault's window).
Every process it starts is stopped at the end, on an error, Ctrl-C or SIGTERM.

Usage (from the repository root, after `cargo build`):

    e2e/.venv/bin/python e2e/soak/soak.py                    # bounded: 2,000 requests, 1 fault cycle
    e2e/.venv/bin/python e2e/soak/soak.py --requests 100000  # the full run: 50 fault cycles
    options: --requests N  --seed S  --concurrency C  --keep (keep the temp dir with every
             log; it is also kept when the soak fails)  --max-seconds T (stop sending after T s)

The venv is e2e/.venv (`python3 -m venv e2e/.venv && e2e/.venv/bin/pip install -r
e2e/requirements.txt`); the binary is $BULKHEAD_BIN (default target/debug/bulkhead). Needs
PostgreSQL's initdb/pg_ctl/postgres (PATH, /usr/local/bin or /usr/lib/postgresql/*/bin;
run as user postgres through runuser when the soak runs as root) and redis-server.
Progress goes to stderr every 10 s.
"""

import argparse
import collections
import glob
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse

import httpx

MODEL = "@cf/huggingfacetb/smollm2-135m-instruct"
EMBED = "@cf/sentence-transformers/all-minilm-l6-v2"
ADMIN = "soak-admin-token-0123456789abcdef"
NODE_API = "soak-node-api-token-0123456789abcdef"
WINDOW = 512
PREFILL_POOL = 1024  # = WINDOW x the default safety factor 2.0
UNIFIED_POOL = 1024
DECODE_POOL = 4096
TRANSFER_LEASE_MS = 3000
STALE_AFTER_S = 5  # platform/src/nodes.rs STALE_AFTER
GRACE_S = 3 * STALE_AFTER_S
REQUESTS_PER_CYCLE = 2000
# Fault order in one cycle, and where each starts (a fraction of the cycle's requests).
FAULTS = ["node_kill", "proxy_corrupt", "replica_kill", "proxy_stall", "pg_restart",
          "proxy_disconnect", "redis_restart"]
FAULT_AT = [0.05, 0.16, 0.27, 0.39, 0.50, 0.62, 0.72]
# One secret word per tenant (none is a part of another).
WORDS = ["KESTREL", "ORCHID", "QUARTZ", "MAPLE", "FALCON", "COBALT", "JUNIPER", "TUNDRA",
         "SAFFRON", "GRANITE", "WALRUS", "PEBBLE", "NEBULA", "CITRINE", "BADGER", "LAGOON",
         "PELICAN", "OSPREY", "VELVET", "ZEPHYR"]
WORKER_TENANTS = 4
WORKER_NAME = "soak"

# kind: (weight, servable)
KINDS = {
    "wai_canary": (8, True), "wai_canary_stream": (6, True), "wai_chat": (3, True),
    "oai_chat": (4, True), "oai_chat_stream": (4, True),
    "wai_embed": (7, True), "oai_embed": (5, True),
    "worker_canary": (3, True), "worker_stream": (2, True), "worker_embed": (2, True),
    "wai_at_limit": (2, True), "oai_at_limit": (1, True),
    "wai_over_pool": (4, False), "wai_over_window": (4, False), "wai_one_past": (4, False),
    "oai_over_window": (3, False), "oai_over_pool": (2, False), "oai_one_past": (2, False),
    "worker_over_window": (2, False), "worker_one_past": (1, False),
}


def log(msg):
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def words(n):
    return " ".join(f"w{i}" for i in range(n))


def strip_padding(v):
    """Workers AI stream frames carry a random alphanumeric `p`: never part of an answer."""
    if isinstance(v, dict):
        return {k: strip_padding(x) for k, x in v.items() if k != "p"}
    if isinstance(v, list):
        return [strip_padding(x) for x in v]
    return v


def pg_bin(name):
    for d in [os.path.dirname(shutil.which(name) or "")] + ["/usr/local/bin"] + \
            sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if d and os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    raise RuntimeError(f"PostgreSQL's {name} not found")


class Fatal(Exception):
    pass


# ---------------------------------------------------------------------------------------
# Processes


class Service:
    """One restartable process of the cluster, logging to DIR/NAME.log."""

    def __init__(self, cluster, name, argv, env=None, health=None):
        self.cluster, self.name, self.argv, self.env, self.health = cluster, name, argv, env, health
        self.proc = None

    def start(self):
        if self.cluster.stop.is_set():
            raise Fatal(f"not starting {self.name}: the soak is stopping")
        logf = open(os.path.join(self.cluster.dir, f"{self.name}.log"), "a")
        logf.write(f"--- start {time.strftime('%H:%M:%S')} ---\n")
        logf.flush()
        self.proc = subprocess.Popen(self.argv, stdout=logf, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, **(self.env or {})),
                                     start_new_session=True)
        logf.close()
        self.cluster.all_procs.append(self.proc)

    def kill9(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def log_tail(self, n=3000):
        try:
            with open(os.path.join(self.cluster.dir, f"{self.name}.log")) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def wait_up(self, seconds=180):
        deadline = time.time() + seconds
        while True:
            if self.proc.poll() is not None:
                raise Fatal(f"{self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if self.health():
                    return
            except Exception:
                pass
            if time.time() > deadline:
                raise Fatal(f"{self.name} did not come up in {seconds}s:\n{self.log_tail()}")
            time.sleep(0.2)


def http_ok(url, headers=None):
    return lambda: httpx.get(url, headers=headers, timeout=2).status_code == 200


def redis_ping(port):
    def ping():
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    return ping


class Postgres:
    """The soak's own PostgreSQL: a data dir in the temp dir, loopback only, run as user
    postgres when we are root (it refuses root)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.port = free_port()
        self.base = os.path.join(cluster.dir, "pg")
        self.data = os.path.join(self.base, "data")
        self.sock = os.path.join(self.base, "sock")
        os.makedirs(self.sock)
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.base, "postgres", "postgres")
            shutil.chown(self.sock, "postgres", "postgres")
        self.log = os.path.join(self.base, "postgres.log")
        self.running = False

    def run(self, args, timeout=120):
        r = subprocess.run(self.as_user + args, capture_output=True, text=True, timeout=timeout,
                           cwd=self.base)
        if r.returncode != 0:
            raise Fatal(f"{' '.join(args)}: {r.stdout}{r.stderr}")
        return r

    def init(self):
        self.run([pg_bin("initdb"), "-D", self.data, "-A", "trust", "-U", "postgres",
                  "-E", "UTF8", "--no-sync"])
        self.start()

    def start(self):
        if self.cluster.stop.is_set():
            raise Fatal("not starting postgres: the soak is stopping")
        # fsync=off is safe here: the faults kill processes, never the machine, and the OS
        # keeps what PostgreSQL wrote. synchronous_commit stays on: with it off, an immediate
        # stop loses transactions already acknowledged (the usage check would count that).
        opts = (f"-h 127.0.0.1 -p {self.port} -k {self.sock} -c fsync=off "
                "-c max_connections=200")
        self.run([pg_bin("pg_ctl"), "-D", self.data, "-l", self.log, "-w", "-t", "60",
                  "-o", opts, "start"])
        self.running = True

    def stop(self, mode="immediate"):
        if self.running:
            self.run([pg_bin("pg_ctl"), "-D", self.data, "-m", mode, "-w", "-t", "60", "stop"])
            self.running = False

    @property
    def url(self):
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"


class KvProxy:
    """A TCP proxy on the KV transfer link (prefill -> decode) that passes, corrupts (flips
    bytes, both directions), stalls (holds every byte) or disconnects (closes every
    connection and refuses new ones)."""

    def __init__(self, upstream_port, seed):
        self.upstream = ("127.0.0.1", upstream_port)
        self.rng = random.Random(seed)
        self.mode = "pass"
        self.lock = threading.Lock()
        self.conns = set()
        self.stopped = False
        self.flipped = 0
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="kvproxy").start()

    def set_mode(self, mode):
        with self.lock:
            self.mode = mode
            if mode == "disconnect":
                for c in list(self.conns):
                    self._close(c)
                self.conns.clear()

    @staticmethod
    def _close(s):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            s.close()
        except OSError:
            pass

    def _accept(self):
        while not self.stopped:
            try:
                c, _ = self.listener.accept()
            except OSError:
                return
            if self.mode == "disconnect":
                self._close(c)
                continue
            try:
                u = socket.create_connection(self.upstream, timeout=5)
                u.settimeout(None)
            except OSError:
                self._close(c)
                continue
            with self.lock:
                self.conns.update((c, u))
            for src, dst in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src, dst):
        try:
            while not self.stopped:
                data = src.recv(65536)
                if not data:
                    break
                while self.mode == "stall" and not self.stopped:
                    time.sleep(0.05)
                if self.mode == "disconnect":
                    break
                if self.mode == "corrupt":
                    with self.lock:
                        if self.rng.random() < 0.7:
                            b = bytearray(data)
                            i = self.rng.randrange(len(b))
                            b[i] ^= 1 << self.rng.randrange(8)
                            data = bytes(b)
                            self.flipped += 1
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self.lock:
                self.conns.discard(src)
                self.conns.discard(dst)
            self._close(src)
            self._close(dst)

    def stop(self):
        self.stopped = True
        self._close(self.listener)
        self.set_mode("disconnect")


# ---------------------------------------------------------------------------------------
# Results


class Res:
    def __init__(self, status=None, body="", headers=None, transport=None, stream=False,
                 events=None):
        self.status, self.body, self.headers = status, body, headers or {}
        self.transport, self.stream, self.events = transport, stream, events or []
        self.t0 = self.t1 = 0.0
        self.replica = None


class Stats:
    MUST_BE_ZERO = ["unservable_2xx", "foreign_canaries", "isolation_alarms",
                    "pages_not_returned", "usage_lost", "usage_overcounted", "unexplained_5xx",
                    "bad_2xx", "unclean_errors", "servable_refused", "own_canary_missing"]

    def __init__(self):
        self.lock = threading.Lock()
        self.c = collections.Counter()
        self.by_cause = collections.Counter()
        self.unexplained_by_cause = collections.Counter()
        self.status = collections.Counter()
        self.answered = collections.Counter()  # tenant -> answered successes
        self.maybe = collections.Counter()  # tenant -> in doubt (may or may not be counted)
        self.findings = []

    def add(self, key, n=1):
        with self.lock:
            self.c[key] += n

    def finding(self, key, detail):
        with self.lock:
            self.c[key] += 1
            if len(self.findings) < 60:
                self.findings.append(f"{key}: {detail}")


# ---------------------------------------------------------------------------------------
# The soak


class Soak:
    def __init__(self, args):
        self.args = args
        self.binary = os.path.abspath(os.environ.get("BULKHEAD_BIN", "target/debug/bulkhead"))
        if not os.path.exists(self.binary):
            raise Fatal(f"no binary at {self.binary} (set BULKHEAD_BIN)")
        self.dir = tempfile.mkdtemp(prefix="bulkhead-soak-")
        # PostgreSQL runs as user postgres: it must reach its data dir inside.
        os.chmod(self.dir, 0o755)
        self.all_procs = []
        self.services = {}
        self.pg = None
        self.proxy = None
        self.stats = Stats()
        self.windows = []  # [name, start, end or None]
        self.replica_kills = []  # (replica index, time)
        self.wlock = threading.Lock()
        self.up = [True, True]
        self.gen = [0, 0]
        self.tls = threading.local()
        self.done = 0
        self.done_lock = threading.Lock()
        self.traffic_over = threading.Event()
        self.stop = threading.Event()
        self.killed_isolation = 0  # isolation alarms of node incarnations killed
        self.faults_run = collections.Counter()
        self.current_fault = "-"
        self.reqlog = open(os.path.join(self.dir, "requests.jsonl"), "a")
        self.reqlog_lock = threading.Lock()
        self.faultlog = open(os.path.join(self.dir, "faults.jsonl"), "a")

    # -- set-up -----------------------------------------------------------------------

    def write(self, name, text, mode=0o644):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, mode)
        return path

    def setup(self):
        t_start = time.time()
        worker_build = {}

        def build_worker():
            # Built once per worker.js and binary (cached in the system's temp dir).
            src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.js")
            with open(src, "rb") as f:
                h = hashlib.sha256(f.read())
            st = os.stat(self.binary)
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
            out = os.path.join(tempfile.gettempdir(), f"bulkhead-soak-worker-{h.hexdigest()[:16]}.wasm")
            worker_build["path"] = out
            if os.path.exists(out):
                worker_build["rc"] = 0
                return
            part = os.path.join(self.dir, "worker.wasm")
            r = subprocess.run([self.binary, "worker", "build", src, "-o", part],
                               capture_output=True, text=True, timeout=900)
            worker_build["rc"], worker_build["out"] = r.returncode, r.stdout + r.stderr
            if r.returncode == 0:
                shutil.copy(part, out + ".part")
                os.replace(out + ".part", out)

        builder = threading.Thread(target=build_worker, daemon=True)
        builder.start()
        r = subprocess.run([self.binary, "models", "fetch"], capture_output=True, text=True,
                           timeout=900)
        if r.returncode != 0:
            raise Fatal(f"bulkhead models fetch: {r.stdout}{r.stderr}")
        key = subprocess.run([self.binary, "transfer-key"], capture_output=True, text=True,
                             check=True, timeout=60).stdout
        self.key_file = self.write("transfer.key", key, 0o600)

        self.pg = Postgres(self)
        self.pg.init()
        self.redis_port = free_port()
        self.services["redis"] = Service(
            self, "redis", ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
                            "--save", "", "--appendonly", "no", "--dir", self.dir],
            health=redis_ping(self.redis_port))
        self.services["redis"].start()
        self.services["redis"].wait_up(30)
        log(f"postgres on {self.pg.port}, redis on {self.redis_port} ({time.time() - t_start:.0f}s)")

        # Two replicas, no model of their own. The first migrates the database alone.
        cfg = self.write("serve.toml", "[node]\ntext_models = []\nembedding_models = []\n")
        self.replicas = []
        rust_log = os.environ.get("SOAK_RUST_LOG", "warn")
        for i in range(2):
            port = free_port()
            data = os.path.join(self.dir, f"replica{i}")
            os.makedirs(data)
            url = f"http://127.0.0.1:{port}"
            svc = Service(self, f"replica{i}", [self.binary, "serve", "--config", cfg],
                          env={"BULKHEAD_ADMIN_TOKEN": ADMIN, "BULKHEAD_DATA": data,
                               "BULKHEAD_LISTEN": f"127.0.0.1:{port}",
                               "BULKHEAD_DATABASE_URL": self.pg.url,
                               "BULKHEAD_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}",
                               "RUST_LOG": rust_log},
                          health=http_ok(url + "/health"))
            svc.url = url
            svc.idx = i
            self.services[f"replica{i}"] = svc
            self.replicas.append(svc)
            svc.start()
            svc.wait_up()
        log(f"replicas up at {self.replicas[0].url}, {self.replicas[1].url} "
            f"({time.time() - t_start:.0f}s)")

        # Nodes: decode, prefill (through the proxy), unified; all heartbeat to both replicas.
        cps = ",".join(r.url for r in self.replicas)
        transfer_port = free_port()
        self.proxy = KvProxy(transfer_port, self.args.seed)
        common = ["--context-window", str(WINDOW), "--control-plane", cps,
                  "--transfer-lease-ms", str(TRANSFER_LEASE_MS)]
        specs = [
            ("decode", ["--role", "decode", "--pool-tokens", str(DECODE_POOL),
                        "--transfer-listen", f"127.0.0.1:{transfer_port}"]),
            ("prefill", ["--role", "prefill", "--pool-tokens", str(PREFILL_POOL),
                         "--decode-peer", f"127.0.0.1:{self.proxy.port}"]),
            ("unified", ["--role", "unified", "--pool-tokens", str(UNIFIED_POOL)]),
        ]
        self.nodes = []
        for name, extra in specs:
            node_id = f"{name}-1"
            tok = self.admin("POST", f"/admin/v1/nodes/{node_id}/tokens", {"name": "soak"})
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            svc = Service(self, name, [self.binary, "node", "--listen", f"127.0.0.1:{port}",
                                       "--node-id", node_id, *extra, *common],
                          env={"BULKHEAD_NODE_TOKEN": tok["token"],
                               "BULKHEAD_NODE_API_TOKEN": NODE_API,
                               "BULKHEAD_TRANSFER_KEY_FILE": self.key_file,
                               "RUST_LOG": rust_log},
                          health=http_ok(url + "/health"))
            svc.url, svc.node_id = url, node_id
            self.services[name] = svc
            self.nodes.append(svc)
            svc.start()
        for svc in self.nodes:
            svc.wait_up()
        for rep in self.replicas:
            self.wait_nodes_registered(rep, [n.node_id for n in self.nodes])
        log(f"nodes up and registered with both replicas ({time.time() - t_start:.0f}s)")

        for m in (MODEL, EMBED):
            self.admin("PATCH", "/admin/v1/models/" + m.replace("/", "%2F"),
                       {"visibility": "public"})

        self.tenants = []
        for i, word in enumerate(WORDS):
            t = self.admin("POST", "/admin/v1/tenants", {"name": f"soak-{i}-{word.lower()}"})
            tok = self.admin("POST", f"/admin/v1/tenants/{t['id']}/tokens", {"name": "soak"})
            self.tenants.append({"i": i, "account": t["id"], "token": tok["token"], "word": word,
                                 "worker": False})

        # Both replicas see the models public before any tenant call.
        t = self.tenants[0]
        for rep in self.replicas:
            for m in (MODEL, EMBED):
                deadline = time.time() + 30
                while httpx.get(f"{rep.url}/client/v4/accounts/{t['account']}/ai/v1/models/{m}",
                                headers={"Authorization": f"Bearer {t['token']}"},
                                timeout=10).status_code != 200:
                    if time.time() > deadline:
                        raise Fatal(f"{rep.name} does not list {m}")
                    time.sleep(0.2)

        # Deploys (each compiles the component, ~10 s here) run while the window is measured
        # and the canaries vetted; one per replica at a time.
        deploy_errors = []

        def deploy(rep, tenants):
            for t in tenants:
                r = httpx.put(f"{rep.url}/client/v4/accounts/{t['account']}/workers/"
                              f"scripts/{WORKER_NAME}?cpu_ms=200", content=wasm,
                              headers={"Authorization": f"Bearer {t['token']}",
                                       "Content-Type": "application/wasm"}, timeout=300)
                if r.status_code != 200:
                    deploy_errors.append(f"worker deploy on {rep.name}: {r.status_code} {r.text}")
                t["worker"] = True

        builder.join()
        log(f"worker built ({time.time() - t_start:.0f}s)")
        if worker_build.get("rc") != 0:
            raise Fatal(f"bulkhead worker build: {worker_build.get('out')}")
        with open(worker_build["path"], "rb") as f:
            wasm = f.read()
        owners = self.tenants[:WORKER_TENANTS]
        deployers = [threading.Thread(target=deploy, args=(rep, owners[rep.idx::2]), daemon=True)
                     for rep in self.replicas]
        for d in deployers:
            d.start()
        self.measure()
        self.vet_canaries()
        for d in deployers:
            d.join()
        if deploy_errors:
            raise Fatal(deploy_errors[0])
        self.worker_tenants = [t for t in self.tenants if t["worker"]]
        # Both replicas serve every worker before traffic starts.
        for rep in self.replicas:
            for t in self.worker_tenants:
                deadline = time.time() + 30
                while True:
                    try:
                        r = httpx.get(rep.url + "/echo", headers={
                            "Host": f"{WORKER_NAME}.{t['account']}.workers.localhost"}, timeout=10)
                        if r.status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.time() > deadline:
                        raise Fatal(f"{rep.name} does not serve the worker of {t['word']}")
                    time.sleep(0.2)
        log(f"{len(self.tenants)} tenants, worker deployed for {len(self.worker_tenants)} "
            f"({time.time() - t_start:.0f}s)")
        log(f"set-up done in {time.time() - t_start:.0f}s")

    def admin(self, method, path, body=None, replica=None):
        rep = replica or self.pick()
        r = httpx.request(method, rep.url + path, json=body, timeout=30,
                          headers={"Authorization": f"Bearer {ADMIN}"})
        if r.status_code != 200:
            raise Fatal(f"{method} {path} on {rep.name}: {r.status_code} {r.text}")
        return r.json()["result"]

    def wait_nodes_registered(self, rep, ids, seconds=60):
        deadline = time.time() + seconds
        while True:
            try:
                nodes = self.admin("GET", "/admin/v1/nodes", replica=rep)
                if {n["id"] for n in nodes if n.get("healthy")} >= set(ids):
                    return True
            except (Fatal, httpx.HTTPError):
                pass
            if time.time() > deadline:
                return False
            time.sleep(0.2)

    def measure(self):
        """Prompts exactly at the window: a raw Workers AI prompt and an OpenAI chat message
        of n tokens (measured), to be sent with max_tokens = WINDOW - n (fits) and one more
        (does not)."""
        t = self.tenants[0]

        def find(make, get_tokens):
            k = 120
            for _ in range(12):
                res = self.setup_call(t, *make(k, 1))
                if res.status == 200:
                    n = get_tokens(json.loads(res.body))
                    if WINDOW - 12 <= n <= WINDOW - 4:
                        return k, n
                    k += max(1, (WINDOW - 8 - n) // 3) if n < WINDOW - 12 else -max(1, (n - WINDOW + 8) // 3)
                elif res.status == 413:
                    k -= 8
                else:
                    raise Fatal(f"measuring the window: {res.status} {res.body} {res.transport}")
            raise Fatal("could not find a prompt just under the window")

        k, self.n_raw = find(
            lambda k, mt: (self.wai_path(t, MODEL), {"prompt": words(k), "raw": True,
                                                     "max_tokens": mt, "temperature": 0}),
            lambda j: j["result"]["usage"]["prompt_tokens"])
        self.at_prompt = words(k)
        k, self.n_chat = find(
            lambda k, mt: ("/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": words(k)}],
                            "max_tokens": mt, "temperature": 0}),
            lambda j: j["usage"]["prompt_tokens"])
        self.at_chat = words(k)
        log(f"at the window: raw prompt {self.n_raw} tokens, chat prompt {self.n_chat} tokens")

    def canary_prompt(self, code):
        return "".join(f"Code: {code}\n" for _ in range(6)) + "Code:"

    def vet_canaries(self):
        """Each tenant's secret code, one the model copies when asked alone (the 135M model
        copies most but not every code)."""
        def vet(t):
            rng = random.Random(self.args.seed * 7919 + t["i"])
            for _ in range(8):
                code = f"{t['word']}-{rng.randrange(1000, 10000)}"
                res = self.setup_call(t, self.wai_path(t, MODEL),
                                      {"prompt": self.canary_prompt(code), "raw": True,
                                       "max_tokens": 12, "temperature": 0})
                if res.status == 200 and code in json.loads(res.body)["result"]["response"]:
                    t["code"], t["vetted"] = code, True
                    return
                t["last"] = f"{res.status} {res.body[:200]}"
            t["code"], t["vetted"] = code, False

        threads = [threading.Thread(target=vet, args=(t,)) for t in self.tenants]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        unvetted = [t["word"] for t in self.tenants if not t["vetted"]]
        log(f"canaries vetted ({len(unvetted)} not copied by the model: {unvetted})")
        for t in self.tenants:
            if not t["vetted"]:
                log(f"  {t['word']}: last answer {t['last']}")

    # -- the client -------------------------------------------------------------------

    def pick(self, rng=random):
        ups = [r for r in self.replicas if self.up[r.idx]]
        return rng.choice(ups or self.replicas)

    def client_for(self, rep):
        cache = getattr(self.tls, "clients", None)
        if cache is None:
            cache = self.tls.clients = {}
        key = (rep.idx, self.gen[rep.idx])
        c = cache.get(key)
        if c is None:
            for k in [k for k in cache if k[0] == rep.idx]:
                cache.pop(k).close()
            c = cache[key] = httpx.Client(timeout=httpx.Timeout(120, connect=5))
        return c

    def wai_path(self, t, model):
        return f"/client/v4/accounts/{t['account']}/ai/run/{model}"

    def setup_call(self, t, path, body):
        """A set-up request, counted like traffic for the usage check."""
        res = self.call(t, path, body)
        with self.stats.lock:
            if res.status == 200:
                self.stats.answered[t["account"]] += 1
            elif res.transport:
                self.stats.maybe[t["account"]] += 1
        return res

    def call(self, t, path, body, stream=False, host=None, attempts=8):
        """One request as the SDKs send it (429 retried after retry-after), to a replica the
        fault schedule has not taken down; a connection that could not be made is tried
        again on another (the request was never sent)."""
        headers = {"Host": host} if host else {"Authorization": f"Bearer {t['token']}"}
        res = None
        tries = 0
        connect_failures = 0
        while True:
            rep = self.pick()
            client = self.client_for(rep)
            t0 = time.time()
            try:
                if stream:
                    res = self._stream(client, rep.url + path, body, headers)
                else:
                    r = client.post(rep.url + path, json=body, headers=headers)
                    res = Res(r.status_code, r.text, r.headers)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                connect_failures += 1
                if connect_failures < 60:
                    time.sleep(0.25)
                    continue
                res = Res(transport=f"connect:{type(e).__name__}")
            except httpx.TimeoutException as e:
                res = Res(transport=f"timeout:{type(e).__name__}", stream=stream)
            except httpx.TransportError as e:
                res = Res(transport=type(e).__name__, stream=stream)
            res.t0, res.t1, res.replica = t0, time.time(), rep
            tries += 1
            if res.status == 429 and tries < attempts:
                try:
                    wait = float(res.headers.get("retry-after", "1"))
                except ValueError:
                    wait = 1.0
                time.sleep(min(max(wait, 0.2), 10))
                continue
            return res

    def _stream(self, client, url, body, headers):
        with client.stream("POST", url, json=body, headers=headers) as r:
            if not 200 <= r.status_code < 300:
                return Res(r.status_code, r.read().decode(errors="replace"), r.headers)
            events, event, data = [], None, []
            for line in r.iter_lines():
                if line == "":
                    if data or event:
                        events.append((event or "message", "\n".join(data)))
                    event, data = None, []
                elif line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    d = line[5:]
                    data.append(d[1:] if d.startswith(" ") else d)
            if data or event:
                events.append((event or "message", "\n".join(data)))
            return Res(r.status_code, "", r.headers, stream=True, events=events)

    # -- traffic ----------------------------------------------------------------------

    def make_job(self, i):
        rng = random.Random(self.args.seed * 1_000_003 + i)
        kinds = list(KINDS)
        kind = rng.choices(kinds, weights=[KINDS[k][0] for k in kinds])[0]
        servable = KINDS[kind][1]
        t = rng.choice(self.worker_tenants if kind.startswith("worker") else self.tenants)
        mt = rng.randint(4, 8)
        canary = self.canary_prompt(t["code"])
        raw_canary = {"prompt": canary, "raw": True, "max_tokens": 12, "temperature": 0}
        oai_path = rng.choice(["/v1/chat/completions",
                               f"/client/v4/accounts/{t['account']}/ai/v1/chat/completions"])
        oai_embed_path = rng.choice(["/v1/embeddings",
                                     f"/client/v4/accounts/{t['account']}/ai/v1/embeddings"])
        texts = [f"{t['word']} note {i}", f"a sentence about {t['word'].lower()} number {i}"]
        stream = rng.random() < 0.4
        job = {"i": i, "kind": kind, "servable": servable, "t": t, "stream": False,
               "host": None, "check_own": False, "shape": "wai_text"}

        def worker(model, body):
            job["host"] = f"{WORKER_NAME}.{t['account']}.workers.localhost"
            job["path"] = "/run?model=" + urllib.parse.quote(model, safe="")
            job["body"] = body

        def chat(content, max_tokens, s=False):
            b = {"model": MODEL, "messages": [{"role": "user", "content": content}],
                 "max_tokens": max_tokens, "temperature": 0}
            if s:
                b["stream"] = True
                if rng.random() < 0.5:
                    b["stream_options"] = {"include_usage": True}
            job.update(path=oai_path, body=b, stream=s, shape="oai_chat")

        if kind in ("wai_canary", "wai_canary_stream"):
            s = kind == "wai_canary_stream"
            job.update(path=self.wai_path(t, MODEL), body=dict(raw_canary, stream=s) if s else raw_canary,
                       stream=s, check_own=t["vetted"])
        elif kind == "wai_chat":
            job.update(path=self.wai_path(t, MODEL), stream=stream,
                       body={"messages": [{"role": "user", "content": f"Say {t['word']} twice."}],
                             "max_tokens": mt, **({"stream": True} if stream else {})})
        elif kind == "oai_chat":
            chat(canary, mt)
        elif kind == "oai_chat_stream":
            chat(canary, mt, True)
        elif kind == "wai_embed":
            job.update(path=self.wai_path(t, EMBED), body={"text": texts}, shape="wai_embed")
        elif kind == "oai_embed":
            job.update(path=oai_embed_path, body={"model": EMBED, "input": texts},
                       shape="oai_embed")
        elif kind == "worker_canary":
            worker(MODEL, raw_canary)
            job.update(shape="worker_text", check_own=t["vetted"])
        elif kind == "worker_stream":
            worker(MODEL, dict(raw_canary, stream=True))
            job.update(stream=True, check_own=t["vetted"])
        elif kind == "worker_embed":
            worker(EMBED, {"text": texts})
            job["shape"] = "worker_embed"
        elif kind == "wai_at_limit":
            job.update(path=self.wai_path(t, MODEL),
                       body={"prompt": self.at_prompt, "raw": True, "temperature": 0,
                             "max_tokens": WINDOW - self.n_raw})
        elif kind == "oai_at_limit":
            chat(self.at_chat, WINDOW - self.n_chat)
        elif kind == "wai_over_pool":
            job.update(path=self.wai_path(t, MODEL), stream=stream,
                       body={"prompt": words(PREFILL_POOL + 100), "raw": True, "max_tokens": mt,
                             **({"stream": True} if stream else {})})
        elif kind == "wai_over_window":
            job.update(path=self.wai_path(t, MODEL), stream=stream,
                       body={"prompt": words(160), "raw": True, "max_tokens": mt,
                             **({"stream": True} if stream else {})})
        elif kind == "wai_one_past":
            job.update(path=self.wai_path(t, MODEL), stream=stream,
                       body={"prompt": self.at_prompt, "raw": True,
                             "max_tokens": WINDOW - self.n_raw + 1,
                             **({"stream": True} if stream else {})})
        elif kind == "oai_over_window":
            chat(words(160), mt, stream)
        elif kind == "oai_over_pool":
            chat(words(PREFILL_POOL + 100), mt, stream)
        elif kind == "oai_one_past":
            chat(self.at_chat, WINDOW - self.n_chat + 1, stream)
        elif kind == "worker_over_window":
            worker(MODEL, {"prompt": words(160), "raw": True, "max_tokens": mt})
        elif kind == "worker_one_past":
            worker(MODEL, {"prompt": self.at_prompt, "raw": True,
                           "max_tokens": WINDOW - self.n_raw + 1})
        else:
            raise AssertionError(kind)
        return job

    def traffic_thread(self, n):
        while not self.stop.is_set():
            with self.done_lock:
                i = self.next_job
                if i >= n or time.time() > self.send_deadline:
                    return
                self.next_job += 1
            job = self.make_job(i)
            try:
                res = self.call(job["t"], job["path"], job["body"], stream=job["stream"],
                                host=job["host"])
                self.judge(job, res)
            except Exception:
                self.stats.finding("soak_exceptions", traceback.format_exc()[-800:])
            with self.done_lock:
                self.done += 1

    # -- judging ----------------------------------------------------------------------

    def in_window(self, t0, t1):
        with self.wlock:
            for _, start, end in self.windows:
                end = time.time() if end is None else end
                if t0 <= end + GRACE_S and t1 >= start:
                    return True
        return False

    def replica_killed(self, rep, t0, t1):
        with self.wlock:
            return any(i == rep.idx and t0 - 1 <= at <= t1 + 1 for i, at in self.replica_kills)

    def foreign(self, job, text):
        for other in self.tenants:
            if other is not job["t"] and other["word"] in text:
                self.stats.finding("foreign_canaries",
                                   f"{job['t']['word']} ({job['kind']}) got {other['word']}: {text[:400]}")

    def judge(self, job, res):
        if res.transport:
            snippet = res.transport
        elif res.stream:
            snippet = " | ".join(f"{e}:{d}" for e, d in res.events[-2:])[-300:]
        else:
            snippet = res.body[:300] if not 200 <= res.status < 300 else res.body[:120]
        with self.reqlog_lock:
            self.reqlog.write(json.dumps({
                "i": job["i"], "kind": job["kind"], "tenant": job["t"]["word"],
                "replica": res.replica.name, "t0": round(res.t0, 3), "t1": round(res.t1, 3),
                "status": res.status, "stream": res.stream, "body": snippet}) + "\n")
        self._judge(job, res)

    def _judge(self, job, res):
        st = self.stats
        t = job["t"]["account"]
        st.add("requests")
        desc = f"#{job['i']} {job['kind']} tenant={job['t']['word']} replica={res.replica.name}"
        with st.lock:
            st.status[res.status or "transport"] += 1

        def error_seen(cause, clean=True):
            # A 5xx, a stream error event or a broken connection: explained by a fault window?
            with st.lock:
                st.by_cause[cause] += 1
            if not self.in_window(res.t0, res.t1):
                st.finding("unexplained_5xx", f"{desc} {cause} {res.body[:300]}")
                with st.lock:
                    st.unexplained_by_cause[cause] += 1

        def in_doubt(why):
            st.add("in_doubt")
            with st.lock:
                st.maybe[t] += 1
            killed = self.replica_killed(res.replica, res.t0, res.t1)
            if not killed:
                st.finding("unclean_errors", f"{desc} {why} without a replica kill "
                                             f"({res.t1 - res.t0:.1f}s)")
            error_seen(f"transport:{why}" if not killed else "replica_killed")

        if res.transport:
            return in_doubt(res.transport)
        status = res.status
        if res.stream:
            texts, done, errors = [], False, []
            for ev, data in res.events:
                if ev == "error":
                    errors.append(data)
                elif data == "[DONE]":
                    done = True
                else:
                    try:
                        j = strip_padding(json.loads(data))
                    except ValueError:
                        st.finding("bad_2xx", f"{desc} a frame that is not JSON: {data[:200]}")
                        continue
                    texts.append(json.dumps(j))
                    piece = j.get("response")
                    if piece is None and j.get("choices"):
                        piece = (j["choices"][0].get("delta") or {}).get("content")
                    if isinstance(piece, str):
                        texts.append("\x00" + piece)
            answer = "".join(p[1:] for p in texts if p.startswith("\x00"))
            self.foreign(job, " ".join(texts) + " ".join(errors))
            if not job["servable"]:
                st.finding("unservable_2xx", f"{desc} stream status {status} done={done}")
            if done and errors:
                st.finding("unclean_errors", f"{desc} a stream with both [DONE] and an error")
            if errors:
                code = None
                try:
                    e = json.loads(errors[0])
                    code = (e.get("errors") or [{}])[0].get("code") if "errors" in e else \
                        (e.get("error") or {}).get("code")
                except (ValueError, AttributeError):
                    pass
                if code is None:
                    st.finding("unclean_errors", f"{desc} a stream error without a code: {errors[0][:200]}")
                return error_seen(f"stream/{code}")
            if not done:
                return in_doubt("stream_cut")
            with st.lock:
                st.answered[t] += 1
            if job["check_own"] and job["servable"] and job["t"]["code"] not in answer:
                st.finding("own_canary_missing", f"{desc} wanted {job['t']['code']}: {answer!r}")
            return

        try:
            body = json.loads(res.body)
        except ValueError:
            body = None
        self.foreign(job, json.dumps(strip_padding(body)) if body is not None else res.body)
        if 200 <= status < 300:
            if not job["servable"]:
                st.finding("unservable_2xx", f"{desc} {status} {res.body[:300]}")
            ok, answer = self.well_formed(job["shape"], body)
            if not ok:
                st.finding("bad_2xx", f"{desc} {status} {res.body[:300]}")
                return
            with st.lock:
                st.answered[t] += 1
            if job["check_own"] and job["servable"] and job["t"]["code"] not in answer:
                st.finding("own_canary_missing", f"{desc} wanted {job['t']['code']}: {answer!r}")
            return
        code = None
        if isinstance(body, dict):
            if body.get("errors"):
                code = body["errors"][0].get("code")
            elif isinstance(body.get("error"), dict):
                code = body["error"].get("code")
            elif "code" in body:
                code = body["code"]
        if job["host"] and not (isinstance(body, dict) and "status" in body and "error" in body):
            # The worker itself failed (not its AI.run): the AI call may have been counted.
            with st.lock:
                st.maybe[t] += 1
        if status == 429:
            st.add("rate_limited_final")
            return
        if 400 <= status < 500:
            if job["servable"]:
                st.finding("servable_refused", f"{desc} {status} {res.body[:300]}")
            return
        if code is None:
            st.finding("unclean_errors", f"{desc} {status} without an error code: {res.body[:300]}")
        elif status == 500 and not job["host"]:
            # A fault is a dependency failing: 502/503 with its code. A 500 is the platform's
            # own bug (a worker's 500 is the worker's answer).
            st.finding("unclean_errors", f"{desc} 500: {res.body[:300]}")
        error_seen(f"{status}/{code}")

    @staticmethod
    def well_formed(shape, j):
        try:
            if shape == "wai_text":
                return j["success"] is True and isinstance(j["result"]["response"], str), \
                    j["result"]["response"]
            if shape == "worker_text":
                return isinstance(j["response"], str), j["response"]
            if shape == "oai_chat":
                c = j["choices"][0]["message"]["content"]
                return isinstance(c, str), c
            if shape in ("wai_embed", "worker_embed"):
                r = j["result"] if shape == "wai_embed" else j
                return (r["shape"] == [2, 384] and len(r["data"]) == 2 and
                        all(len(v) == 384 for v in r["data"])), ""
            if shape == "oai_embed":
                return (len(j["data"]) == 2 and
                        all(len(d["embedding"]) == 384 for d in j["data"])), ""
        except (KeyError, IndexError, TypeError):
            return False, ""
        raise AssertionError(shape)

    # -- faults -----------------------------------------------------------------------

    def open_window(self, name):
        w = [name, time.time(), None]
        with self.wlock:
            self.windows.append(w)
        self.current_fault = name
        log(f"fault: {name}")
        self.fault_log(name, "start", w[1])
        return w

    def fault_log(self, name, what, at):
        with self.reqlog_lock:
            self.faultlog.write(json.dumps({"fault": name, what: round(at, 3)}) + "\n")
            self.faultlog.flush()

    def close_window(self, w):
        with self.wlock:
            w[2] = time.time()
        self.current_fault = "-"
        self.faults_run[w[0].split()[0]] += 1
        self.fault_log(w[0], "end", w[2])
        log(f"fault over: {w[0]} ({w[2] - w[1]:.1f}s)")

    def sleep(self, s):
        # Faults always run to their end (the cluster must be whole for the final checks).
        time.sleep(s)

    def fault(self, name, cycle):
        if name == "node_kill":
            node = self.services["unified"]
            self.killed_isolation += self.node_isolation(node)
            w = self.open_window("node_kill unified")
            node.kill9()
            self.sleep(3)
            node.start()
            node.wait_up()
            for rep in self.replicas:
                self.wait_nodes_registered(rep, [node.node_id], 30)
            self.close_window(w)
        elif name == "replica_kill":
            rep = self.replicas[cycle % 2]
            w = self.open_window(f"replica_kill {rep.name}")
            with self.wlock:
                self.up[rep.idx] = False
                self.replica_kills.append((rep.idx, time.time()))
            rep.kill9()
            self.sleep(5)
            rep.start()
            rep.wait_up()
            with self.wlock:
                self.gen[rep.idx] += 1
                self.up[rep.idx] = True
            self.close_window(w)
        elif name == "pg_restart":
            w = self.open_window("pg_restart")
            self.pg.stop("immediate")
            self.sleep(10)
            self.pg.start()
            self.close_window(w)
        elif name == "redis_restart":
            redis = self.services["redis"]
            w = self.open_window("redis_restart")
            redis.kill9()
            self.sleep(5)
            redis.start()
            redis.wait_up(30)
            self.close_window(w)
        elif name.startswith("proxy_"):
            mode = name[len("proxy_"):]
            w = self.open_window(name)
            self.proxy.set_mode(mode)
            self.sleep({"corrupt": 8, "stall": 8, "disconnect": 6}[mode])
            self.proxy.set_mode("pass")
            self.close_window(w)
        else:
            raise AssertionError(name)

    def fault_thread(self, n):
        cycles = max(1, round(n / REQUESTS_PER_CYCLE))
        plan = [((c + at) / cycles * n, name, c) for c in range(cycles)
                for at, name in zip(FAULT_AT, FAULTS)]
        try:
            for at, name, cycle in plan:
                while self.done < at and not self.traffic_over.is_set():
                    time.sleep(0.1)
                if self.traffic_over.is_set():
                    log(f"traffic over before the fault {name} of cycle {cycle}: skipped")
                    self.stats.add("faults_skipped")
                    continue
                self.fault(name, cycle)
        except Exception:
            self.fault_error = traceback.format_exc()
            log(f"the fault schedule failed: {self.fault_error}")
            self.stop.set()

    # -- final checks -----------------------------------------------------------------

    def node_get(self, node, path):
        r = httpx.get(node.url + path, headers={"Authorization": f"Bearer {NODE_API}"}, timeout=10)
        r.raise_for_status()
        return r

    def node_isolation(self, node):
        """The isolation alarms a node has raised: its pools' counters and any isolation
        metric (the larger: they count the same events)."""
        try:
            state = self.node_get(node, "/v1/state").json()
            pools = sum((m.get("pool") or {}).get("isolation_violations", 0)
                        for m in state.get("models", []))
            metric = self.metric_sum(self.node_get(node, "/metrics").text, "isolation")
            return max(pools, metric)
        except httpx.HTTPError as e:
            log(f"isolation of {node.name}: {e}")
            return 0

    @staticmethod
    def metric_sum(text, word):
        total = 0.0
        for line in text.splitlines():
            if line.startswith("#") or word not in line.split("{")[0].split(" ")[0]:
                continue
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                pass
        return int(total)

    def final_checks(self):
        st = self.stats
        # Everything is up again: wait until both replicas see all nodes.
        for rep in self.replicas:
            rep.wait_up(60)
            if not self.wait_nodes_registered(rep, [n.node_id for n in self.nodes], 60):
                st.finding("nodes_not_back", f"{rep.name} does not list every node healthy")
        # (a) pools whole again
        for node in self.nodes:
            deadline = time.time() + 30
            while True:
                try:
                    state = self.node_get(node, "/v1/state").json()
                    pools = [m for m in state.get("models", []) if m.get("pool")]
                    bad = [m for m in pools if not (
                        m["pool"]["pages_free"] == m["pool"]["pages_total"]
                        and m["pool"]["pages_reserved"] == 0 and m.get("running", 0) == 0)]
                    if not any(m.get("name") == MODEL for m in pools):
                        bad.append(f"no pool of {MODEL} in its state: {state}")
                except httpx.HTTPError as e:
                    bad = [str(e)]
                if not bad:
                    break
                if time.time() > deadline:
                    for m in bad:
                        st.finding("pages_not_returned", f"{node.name}: {m}")
                    break
                time.sleep(0.5)
        # (b) isolation alarms, nodes (this and killed incarnations) and replicas
        alarms = self.killed_isolation + sum(self.node_isolation(n) for n in self.nodes)
        for node in self.nodes:
            # The alarm metric is there to be read (a renamed metric would read as 0).
            if not any("isolation" in line and not line.startswith("#")
                       for line in self.node_get(node, "/metrics").text.splitlines()):
                st.finding("isolation_alarms", f"{node.name} exports no isolation metric")
        for rep in self.replicas:
            try:
                r = httpx.get(rep.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"},
                              timeout=10)
                alarms += self.metric_sum(r.text, "isolation")
            except httpx.HTTPError as e:
                log(f"metrics of {rep.name}: {e}")
        if alarms:
            st.finding("isolation_alarms", f"{alarms} isolation alarms")
            st.c["isolation_alarms"] = alarms
        # informational: KV transfers that failed (corruption, stalls, disconnects)
        try:
            m = self.node_get(self.services["decode"], "/metrics").text
            st.c["kv_transfers_failed"] = self.metric_sum(m, "kv_transfers_failed")
        except httpx.HTTPError:
            pass
        # (c) usage: stable for two reads a second and a half apart (flushed every 500 ms)
        time.sleep(2)
        prev, deadline = None, time.time() + 60
        while True:
            rows = self.admin("GET", "/admin/v1/usage")
            counted = collections.Counter()
            for r in rows:
                counted[r["tenant_id"]] += r["requests"] - sum(r.get("errors", {}).values())
            if counted == prev or time.time() > deadline:
                break
            prev = counted
            time.sleep(1.5)
        for tn in self.tenants:
            a = tn["account"]
            answered, maybe, c = st.answered[a], st.maybe[a], counted[a]
            if c < answered:
                st.c["usage_lost"] += answered - c
                st.findings.append(f"usage_lost: {tn['word']} answered {answered}, counted {c}")
            if c > answered + maybe:
                st.c["usage_overcounted"] += c - answered - maybe
                st.findings.append(f"usage_overcounted: {tn['word']} answered {answered} "
                                   f"+ in doubt {maybe}, counted {c}")
        st.c["usage_counted"] = sum(counted[tn["account"]] for tn in self.tenants)
        st.c["answered"] = sum(st.answered.values())

    # -- run --------------------------------------------------------------------------

    def progress(self, t_start, n):
        c = self.stats.c
        el = time.time() - t_start
        log(f"{self.done}/{n} requests, {self.done / max(el, 1e-9):.1f}/s, fault {self.current_fault}, "
            f"5xx/errors {sum(self.stats.by_cause.values())}, in doubt {c['in_doubt']}, "
            f"must-be-zero so far {sum(c[k] for k in Stats.MUST_BE_ZERO)}")

    def run(self):
        t_all = time.time()
        self.setup()
        n = self.args.requests
        self.next_job = 0
        t_start = time.time()
        self.send_deadline = t_start + self.args.max_seconds
        self.fault_error = None
        faults = threading.Thread(target=self.fault_thread, args=(n,), daemon=True, name="faults")
        faults.start()
        workers = [threading.Thread(target=self.traffic_thread, args=(n,), daemon=True)
                   for _ in range(self.args.concurrency)]
        for w in workers:
            w.start()
        last = time.time()
        while any(w.is_alive() for w in workers):
            time.sleep(0.5)
            if time.time() - last >= 10:
                self.progress(t_start, n)
                last = time.time()
        self.traffic_over.set()
        faults.join()
        traffic_s = time.time() - t_start
        if self.done < n:
            self.stats.finding("deadline_hit", f"{self.done} of {n} requests sent in "
                                               f"{traffic_s:.0f}s")
        if self.fault_error:
            raise Fatal(f"the fault schedule failed: {self.fault_error}")
        log(f"traffic done: {self.done} requests in {traffic_s:.0f}s; final checks")
        self.final_checks()
        return time.time() - t_all, traffic_s

    def report(self, elapsed, traffic_s):
        st = self.stats
        for f in st.findings:
            log(f)
        c = st.c
        line = (f"soak: requests={c['requests']} "
                + " ".join(f"{k}={c[k]}" for k in Stats.MUST_BE_ZERO)
                + f" 5xx_by_cause={json.dumps(dict(sorted(st.by_cause.items())), separators=(',', ':'))}"
                + f" unexplained_by_cause={json.dumps(dict(st.unexplained_by_cause), separators=(',', ':'))}"
                + f" in_doubt={c['in_doubt']}"
                + f" answered={c['answered']} usage_counted={c['usage_counted']}"
                + f" rate_limited_final={c['rate_limited_final']} kv_transfers_failed={c['kv_transfers_failed']}"
                + f" kv_bytes_flipped={self.proxy.flipped if self.proxy else 0}"
                + f" faults={json.dumps(dict(self.faults_run), separators=(',', ':'))}"
                + f" faults_skipped={c['faults_skipped']} deadline_hit={c['deadline_hit']}"
                + f" nodes_not_back={c['nodes_not_back']}"
                + f" soak_exceptions={c['soak_exceptions']}"
                + f" statuses={json.dumps({str(k): v for k, v in sorted(st.status.items(), key=str)}, separators=(',', ':'))}"
                + f" traffic_s={traffic_s:.0f} elapsed_s={elapsed:.0f}")
        print(line, flush=True)
        bad = any(c[k] for k in Stats.MUST_BE_ZERO) or c["deadline_hit"] or c["soak_exceptions"] \
            or c["nodes_not_back"]
        return 1 if bad else 0

    def cleanup(self, keep):
        self.reqlog.close()
        self.faultlog.close()
        if self.proxy:
            self.proxy.stop()
        for p in self.all_procs:
            if p.poll() is None:
                p.terminate()
        for p in self.all_procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for p in self.all_procs:  # anything a fault restarted meanwhile
            if p.poll() is None:
                p.kill()
                p.wait()
        if self.pg:
            try:
                self.pg.stop("fast")
            except Exception as e:
                log(f"stopping postgres: {e}")
        if keep:
            log(f"kept {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir with the logs")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop sending after this long (default 600 + 0.3 s a request)")
    args = ap.parse_args()
    if args.max_seconds is None:
        args.max_seconds = 600 + 0.3 * args.requests

    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)

    soak = None
    rc = 2
    try:
        soak = Soak(args)
        elapsed, traffic_s = soak.run()
        rc = soak.report(elapsed, traffic_s)
    except KeyboardInterrupt:
        log("interrupted")
        rc = 130
    except Fatal as e:
        log(f"soak could not run: {e}")
        print(f"soak: error={str(e).splitlines()[0][:300]}", flush=True)
    except Exception:
        log(traceback.format_exc())
        print("soak: error=exception", flush=True)
    finally:
        if soak is not None:
            soak.stop.set()
            soak.cleanup(args.keep or rc != 0)
    sys.exit(rc)


if __name__ == "__main__":
    main()
