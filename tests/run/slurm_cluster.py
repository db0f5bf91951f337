"""A real Slurm (munged, slurmctld, slurmd from Debian's packages) in a temporary directory.

Everything lives under one directory: the munge key and socket, slurm.conf,
state, spool and logs. The daemons run in the foreground as children of the
test, on ports found free, so several test runs on one machine do not meet.
Running as root inside a container needs no cgroups: processes are tracked
from /proc (proctrack/linuxproc), tasks are not bound (task/none), slurmd runs
as root (SlurmdUser=root).

Cluster(root) is one node: this machine's short hostname at 127.0.0.1.

Cluster(root, nodes=K) emulates K nodes on this machine. Each node is one
slurmd in its own network and UTS namespace (`unshare --uts --net`): its own
hostname (`cluster.nodes`, e.g. pnqxa1..pnqxa3, the letters random per
cluster so that overlapping runs never share a name), its own loopback and
one veth link to a bridge in the root namespace, where slurmctld, munged and
the test's sbatch/scontrol run. The bridge holds the first address of a
private /24 subnet that no other interface uses (10.213.X.1, taken under a
lock file); node i holds .(i+1). The file system is shared: the munge socket
(a path, so reachable from every namespace), slurm.conf, per-node spool
(spool/NAME) and logs (log/slurmd.NAME.log). A job's tasks run in their
node's namespaces, so `hostname` names their node, `srun -N K hostname` from
inside a batch job reaches every slurmd over the bridge, and BatchHost is the
first node. SlurmdTimeout (slurmd_timeout, 6 s) and MessageTimeout
(message_timeout, 5 s) are short, so that a killed node is DOWN about 12 s
later (measured here; Slurm's defaults take minutes).

Faults, for tests: kill_node(NAME) SIGKILLs every process in the node's
network namespace (slurmd, slurmstepd, the job's tasks), which also removes
its link; start_node(NAME) starts it again. freeze_node/thaw_node SIGSTOP/
SIGCONT them (alive but silent); cut_link/restore_link take its link down and
up. node(NAME) is `scontrol show node` as a dict; wait_node(NAME, states)
waits for one of the states; in_node(NAME, argv) runs a command in its
namespaces.

Teardown (stop(), also run at interpreter exit and by `with Cluster(...)`)
cancels jobs, stops the daemons, kills every process left in a node's
namespace (so the namespaces and their veth ends go) and deletes the bridge.
The daemons (munged, slurmctld, the slurmds) die with the test process
(PR_SET_PDEATHSIG); what a test killed with SIGKILL still leaves (its jobs'
slurmstepds and tasks, in the nodes' namespaces noted in
/tmp/pacer-slurm-nodes/, and its links) is ended when the next multi-node
cluster starts. Link names carry the owner's pid:
pc<pid hex>-<seq>b (bridge), pc<pid hex>-<seq>v<i> (a node's root-side veth).

missing_reason(nodes=K) says why the machine cannot run it (no Slurm or
munge, not root, no ip/unshare/nsenter, no CAP_NET_ADMIN to make a bridge
or namespaces, as in a container without it), or None.
"""
import atexit
import ctypes
import fcntl
import os
import random
import re
import signal
import string
import shutil
import socket
import subprocess
import time
import unittest

DAEMONS = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name):
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


NET_TOOLS = ["ip", "unshare", "nsenter"]
_seq = 0  # clusters started by this process, for unique link names


def _link_prefix(pid):
    return f"pc{pid:x}-"


def missing_reason(nodes=None):
    """Why this machine cannot run the cluster (with nodes=K: K emulated nodes), or None."""
    missing = [d for d in DAEMONS if not _which(d)]
    if missing:
        return f"Slurm or munge is not installed (missing {', '.join(missing)}; scripts/deps.sh installs slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs as their user; these tests run as uid %d" % os.geteuid()
    if nodes is None:
        return None
    missing = [t for t in NET_TOOLS if not _which(t)]
    if missing:
        return f"emulated nodes need {', '.join(missing)} (iproute2, util-linux)"
    u = subprocess.run([_which("unshare"), "--uts", "--net", "true"], capture_output=True, text=True)
    if u.returncode != 0:
        return f"cannot make network/UTS namespaces (unshare --uts --net: {u.stderr.strip()}); no CAP_SYS_ADMIN here?"
    probe = _link_prefix(os.getpid()) + "probe"
    r = subprocess.run([_which("ip"), "link", "add", probe, "type", "bridge"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot make a bridge in the root network namespace (ip link add: {r.stderr.strip()}); no CAP_NET_ADMIN here?"
    subprocess.run([_which("ip"), "link", "del", probe], capture_output=True)
    return None


def start_or_skip(root, nodes=None, on_failure=None):
    """A started Cluster(root, nodes), for a test's setUpClass.

    When Slurm does not come up, the cluster is stopped, `on_failure` (if
    given) runs, and unittest.SkipTest is raised naming why; with
    PACER_REQUIRE_SLURM=1 an AssertionError instead.
    """
    cluster = Cluster(root, nodes=nodes)
    why = cluster.start()
    if not why:
        return cluster
    cluster.stop()
    if on_failure:
        on_failure()
    if os.environ.get("PACER_REQUIRE_SLURM") == "1":
        raise AssertionError("Slurm did not come up: " + why)
    raise unittest.SkipTest("Slurm did not come up on this machine: " + why)


def _ip(*args, check=True):
    r = subprocess.run([_which("ip"), *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


# Each multi-node cluster notes its nodes' network namespaces here (a file
# named like its links), so that a later run can end what a killed one left.
NS_REGISTRY = "/tmp/pacer-slurm-nodes"


def _owner_gone(pid):
    try:
        os.kill(pid, 0)
        return False
    except ProcessLookupError:
        return True
    except PermissionError:
        return False


def _pids_in_namespaces(namespaces):
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in namespaces:
            pids.append(int(entry))
    return pids


def _sweep_stale():
    """Ends what a test process that is gone (killed before its teardown) left: the processes in its nodes'
    namespaces (slurmstepd and tasks outlive slurmd) and its links."""
    try:
        names = os.listdir(NS_REGISTRY)
    except FileNotFoundError:
        names = []
    for name in names:
        m = re.fullmatch(r"pc([0-9a-f]+)-[0-9a-f]+", name)
        if not m or not _owner_gone(int(m.group(1), 16)):
            continue
        path = os.path.join(NS_REGISTRY, name)
        try:
            with open(path) as f:
                lines = [line.split() for line in f]
        except OSError:
            continue
        conf = next((w[1] for w in lines if len(w) == 2 and w[0] == "conf"), None)
        namespaces = {(int(w[1]), int(w[2])) for w in lines if len(w) == 3 and w[0] == "ns"}
        # A freed namespace's inode can come back for another's: only a
        # process of that cluster (its SLURM_CONF) is killed.
        mark = f"SLURM_CONF={conf}".encode()
        for pid in _pids_in_namespaces(namespaces):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if conf and mark in f.read().split(b"\0"):
                        os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    out = _ip("-o", "link", "show", check=False).stdout
    for name in re.findall(r"^\d+: (pc[0-9a-f]+-[0-9a-f]+[bv]\d*)[@:]", out, re.M):
        if _owner_gone(int(name[2:name.index("-")], 16)):
            _ip("link", "del", name, check=False)


_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    # The node's slurmd must not outlive a test that was killed.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Cluster:
    def __init__(self, root, nodes=None, slurmd_timeout=6, message_timeout=5, cpus=None):
        self.root = root
        self.procs = []
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(root, "slurm.conf")
        # Nothing of an outer Slurm job (a CI runner inside one) may leak in.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = self.conf
        self.count = nodes
        self.slurmd_timeout = slurmd_timeout
        self.message_timeout = message_timeout
        self.cpus = cpus or os.cpu_count() or 1
        self.nodes = [self.host]
        self.node_procs = {}  # name -> the Popen of its slurmd (the namespace's first process)
        self.node_ns = {}  # name -> (st_dev, st_ino) of its network namespace
        self.node_addr = {}
        self.bridge = None
        self.stopped = False
        # Multi-node daemons die with the test process; one node stays as it always was.
        self._preexec = None if nodes is None else _die_with_parent
        if nodes is not None:
            if nodes < 1 or nodes > 200:
                raise ValueError(f"nodes={nodes}: 1 to 200 emulated nodes")
            global _seq
            _seq += 1
            self.links = _link_prefix(os.getpid()) + f"{_seq:x}"
            tag = "".join(random.choice(string.ascii_lowercase) for _ in range(3))
            self.nodes = [f"pn{tag}{i}" for i in range(1, nodes + 1)]
            self.veth = {n: f"{self.links}v{i}" for i, n in enumerate(self.nodes, 1)}
        else:
            self.node_addr[self.host] = "127.0.0.1"
        atexit.register(self.stop)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def _log_tail(self, name, n=15):
        path = os.path.join(self.root, "log", name)
        try:
            with open(path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def start(self, timeout=40):
        """Starts munge, slurmctld and the slurmd(s); returns None, or why the cluster did not come up.

        An exception on the way stops what was started before it propagates.
        """
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout):
        for d in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        os.chmod(os.path.join(self.root, "munge"), 0o711)
        key = os.path.join(self.root, "munge", "munge.key")
        subprocess.run([_which("mungekey"), "--create", "--keyfile", key], check=True, capture_output=True)
        os.chmod(key, 0o600)
        self.munge_socket = os.path.join(self.root, "munge", "munge.sock")
        self.procs.append(subprocess.Popen(
            [_which("munged"), "--foreground", "--force", "--key-file", key, "--socket", self.munge_socket,
             "--pid-file", os.path.join(self.root, "munge", "munged.pid"),
             "--log-file", os.path.join(self.root, "log", "munged.log"),
             "--seed-file", os.path.join(self.root, "munge", "munged.seed")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=self._preexec))
        for _ in range(50):
            if os.path.exists(self.munge_socket):
                break
            time.sleep(0.1)
        else:
            return "munged did not create its socket: " + self._log_tail("munged.log")
        cpus = self.cpus
        r = self.root
        if self.count is None:
            ctld_addr = "127.0.0.1"
            slurmd_files = f"""SlurmdSpoolDir={r}/spool
SlurmdPidFile={r}/slurmd.pid"""
            slurmd_log = f"SlurmdLogFile={r}/log/slurmd.log"
            node_lines = f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN"
            extra = ""
        else:
            ctld_addr = self._make_bridge()
            slurmd_files = f"""SlurmdSpoolDir={r}/spool/%n
SlurmdPidFile={r}/spool/%n/slurmd.pid"""
            slurmd_log = f"SlurmdLogFile={r}/log/slurmd.%n.log"
            node_lines = "\n".join(f"NodeName={n} NodeAddr={self.node_addr[n]} CPUs={cpus} RealMemory=1000 State=UNKNOWN"
                                   for n in self.nodes)
            # A dead node is DOWN within seconds, not Slurm's 5 minutes: the
            # ping that finds it silent waits MessageTimeout, and DOWN comes
            # SlurmdTimeout after its last answer.
            extra = f"SlurmdTimeout={self.slurmd_timeout}\nMessageTimeout={self.message_timeout}\n"
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=pacertest
SlurmctldHost={self.host}({ctld_addr})
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={r}/state
{slurmd_files}
SlurmctldPidFile={r}/slurmctld.pid
SlurmctldLogFile={r}/log/slurmctld.log
{slurmd_log}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
OverTimeLimit=1
MinJobAge=600
{extra}{node_lines}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        self.procs.append(subprocess.Popen([_which("slurmctld"), "-D", "-i", "-f", self.conf], env=self.env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                           preexec_fn=self._preexec))
        if self.count is None:
            self.procs.append(subprocess.Popen([_which("slurmd"), "-D", "-f", self.conf], env=self.env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        else:
            for n in self.nodes:
                self.start_node(n)
        deadline = time.time() + timeout
        while time.time() < deadline:
            for p in self.procs + list(self.node_procs.values()):
                if p.poll() is not None:
                    return f"{p.args[0]} exited with {p.returncode}: {self._logs()}"
            if self.count is None:
                s = subprocess.run([_which("sinfo"), "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
                if s.returncode == 0 and s.stdout.strip() == "idle":
                    return None
            else:
                s = subprocess.run([_which("sinfo"), "-h", "-N", "-o", "%T"], env=self.env, capture_output=True,
                                   text=True)
                if s.returncode == 0 and s.stdout.split() == ["idle"] * len(self.nodes):
                    return None
            time.sleep(0.5)
        return f"not every node idle within {timeout} s: {self._logs()}"

    def _logs(self):
        names = ["slurmd.log"] if self.count is None else [f"slurmd.{n}.log" for n in self.nodes]
        return f"slurmctld.log: {self._log_tail('slurmctld.log')} " + " ".join(
            f"{n}: {self._log_tail(n)}" for n in names)

    def _make_bridge(self):
        """Makes the bridge on a free 10.213.X.0/24; returns its address (slurmctld's)."""
        _sweep_stale()
        # Two test runs choosing at once must not take the same subnet.
        with open("/tmp/pacer-slurm-net.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            used = set(re.findall(r"\b10\.213\.(\d+)\.", _ip("-o", "-4", "addr", "show").stdout))
            free = [x for x in range(256) if str(x) not in used]
            if not free:
                raise RuntimeError("no free 10.213.X.0/24 subnet for the emulated nodes' bridge")
            x = random.choice(free)
            bridge = self.links + "b"
            _ip("link", "add", bridge, "type", "bridge")
            self.bridge = bridge
            _ip("addr", "add", f"10.213.{x}.1/24", "dev", bridge)
            _ip("link", "set", bridge, "up")
        for i, n in enumerate(self.nodes, 1):
            self.node_addr[n] = f"10.213.{x}.{i + 1}"
        return f"10.213.{x}.1"

    def start_node(self, name):
        """Starts (or, after kill_node, restarts) the node's slurmd in fresh namespaces linked to the bridge."""
        if name in self.node_procs and self.node_procs[name].poll() is None:
            raise RuntimeError(f"node {name} is running")
        veth = self.veth[name]
        _ip("link", "del", veth, check=False)  # a killed node's link can outlive it for a moment
        os.makedirs(os.path.join(self.root, "spool", name), exist_ok=True)
        own = os.stat("/proc/self/ns/net").st_ino
        # The shell waits for "go" until the link is configured, so slurmd
        # registers from its address at once.
        p = subprocess.Popen(
            [_which("unshare"), "--uts", "--net", "--", "/bin/sh", "-c",
             'hostname "$1" && read go && exec "$2" -D -N "$1" -f "$3" </dev/null', "sh", name, _which("slurmd"),
             self.conf],
            stdin=subprocess.PIPE, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent)
        self.node_procs[name] = p
        try:
            deadline = time.time() + 10
            while True:
                try:
                    st = os.stat(f"/proc/{p.pid}/ns/net")
                except FileNotFoundError:
                    st = None
                if p.poll() is not None:
                    raise RuntimeError(f"unshare for node {name} exited with {p.returncode}")
                if st is not None and st.st_ino != own:
                    break
                if time.time() > deadline:
                    raise RuntimeError(f"node {name}: no network namespace within 10 s")
                time.sleep(0.01)
            self.node_ns[name] = (st.st_dev, st.st_ino)
            os.makedirs(NS_REGISTRY, mode=0o700, exist_ok=True)
            reg = os.path.join(NS_REGISTRY, self.links)
            with open(reg, "a") as f:
                if f.tell() == 0:
                    f.write(f"conf {self.conf}\n")
                f.write(f"ns {st.st_dev} {st.st_ino}\n")
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(p.pid))
            _ip("link", "set", veth, "master", self.bridge, "up")
            cfg = subprocess.run([_which("nsenter"), "-t", str(p.pid), "-n", _which("ip"), "-batch", "-"],
                                 input=f"link set lo up\naddr add {self.node_addr[name]}/24 dev eth0\nlink set eth0 up\n",
                                 capture_output=True, text=True)
            if cfg.returncode != 0:
                raise RuntimeError(f"node {name}: configuring its link failed: {cfg.stderr.strip()}")
            p.stdin.write(b"go\n")
            p.stdin.close()
        except BaseException:
            p.kill()
            p.wait()
            raise

    def _ns_pids(self, name):
        """Every process in the node's network namespace."""
        ns = self.node_ns.get(name)
        return _pids_in_namespaces({ns}) if ns else []

    def _signal_node(self, name, sig):
        for pid in self._ns_pids(name):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill_node(self, name, timeout=10):
        """A dead node: SIGKILLs its slurmd, slurmstepds and tasks; its namespaces and link go with them."""
        deadline = time.time() + timeout
        while True:
            pids = self._ns_pids(name)
            if not pids:
                break
            if time.time() > deadline:
                raise RuntimeError(f"node {name}: processes {pids} survive SIGKILL")
            self._signal_node(name, signal.SIGKILL)
            time.sleep(0.05)
        p = self.node_procs.get(name)
        if p is not None:
            p.wait()

    def freeze_node(self, name):
        """A node alive but silent: SIGSTOPs every process in it."""
        self._signal_node(name, signal.SIGSTOP)

    def thaw_node(self, name):
        self._signal_node(name, signal.SIGCONT)

    def cut_link(self, name):
        """A node cut off the network: its link goes down, its processes keep running."""
        _ip("link", "set", self.veth[name], "down")

    def restore_link(self, name):
        _ip("link", "set", self.veth[name], "up")

    def in_node(self, name, argv, **kwargs):
        """Runs argv in the node's network and UTS namespaces (subprocess.run; output captured as text)."""
        pids = self._ns_pids(name)
        if not pids:
            raise RuntimeError(f"node {name} has no process (killed?)")
        return subprocess.run([_which("nsenter"), "-t", str(pids[0]), "-n", "-u", *argv], env=self.env,
                              capture_output=True, text=True, **kwargs)

    def node(self, name):
        """scontrol show node as a dict of its Key=Value fields."""
        out = subprocess.run([_which("scontrol"), "show", "node", name], env=self.env, capture_output=True, text=True)
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout))

    def wait_node(self, name, states, timeout=30):
        """Waits until the node's state (its base word: DOWN of DOWN*+DRAIN) is one of states; returns the node."""
        deadline = time.time() + timeout
        while True:
            n = self.node(name)
            if re.split(r"[^A-Z_]", n.get("State", ""))[0] in states:
                return n
            if time.time() > deadline:
                raise AssertionError(f"node {name} not in {states} within {timeout} s: {n}")
            time.sleep(0.5)

    def stop(self):
        if self.stopped:
            return
        self.stopped = True
        subprocess.run([_which("scancel"), "--user", "root"], env=self.env, capture_output=True)
        for p in self.node_procs.values():
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for name, p in self.node_procs.items():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            # slurmstepds and tasks left on the node keep its namespaces alive.
            try:
                self.kill_node(name)
            except RuntimeError:
                pass
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.bridge:
            _ip("link", "del", self.bridge, check=False)
            self.bridge = None
        if self.count is not None and not any(self._ns_pids(n) for n in self.nodes):
            try:
                os.unlink(os.path.join(NS_REGISTRY, self.links))
            except FileNotFoundError:
                pass

    def sbatch(self, script_path, env=None):
        out = subprocess.run([_which("sbatch"), "--parsable", script_path], env=dict(self.env, **(env or {})),
                             capture_output=True, text=True, check=True)
        return out.stdout.strip().split(";")[0]

    def job(self, job_id):
        """scontrol show job as a dict of its Key=Value fields."""
        out = subprocess.run([_which("scontrol"), "show", "job", job_id], env=self.env, capture_output=True, text=True)
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout))

    @staticmethod
    def _seconds_until(local_time):
        try:
            return time.mktime(time.strptime(local_time, "%Y-%m-%dT%H:%M:%S")) - time.time()
        except (TypeError, ValueError):
            return 0

    def wait(self, job_id, timeout):
        """Waits for the job to end, releasing it at once when requeued.

        Slurm holds a requeued job for about two minutes (Reason=BeginTime);
        the test lets it start again after two seconds instead. Not at once:
        slurmd refuses a job whose new credential dates from the same second
        as the one revoked by the requeue ("Job credential revoked").
        """
        deadline = time.time() + timeout
        while time.time() < deadline:
            j = self.job(job_id)
            state = j.get("JobState")
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"):
                return j
            if state == "PENDING" and j.get("Reason") == "BeginTime" and self._seconds_until(j.get("EligibleTime")) > 10:
                subprocess.run([_which("scontrol"), "update", f"JobId={job_id}", "StartTime=now+2"], env=self.env,
                               capture_output=True)
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} did not end within {timeout} s: {self.job(job_id)}")
