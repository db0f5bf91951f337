"""A real single-node Slurm (munged, slurmctld, slurmd from Debian's packages) in a temporary directory.

Everything lives under one directory: the munge key and socket, slurm.conf,
state, spool and logs. The daemons run in the foreground as children of the
test, on ports found free, so several test runs on one machine do not meet.
Running as root inside a container needs no cgroups: processes are tracked
from /proc (proctrack/linuxproc), tasks are not bound (task/none), slurmd runs
as root (SlurmdUser=root).
"""
import os
import re
import shutil
import socket
import subprocess
import time

DAEMONS = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name):
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")


def missing_reason():
    """Why this machine cannot run the cluster, or None."""
    missing = [d for d in DAEMONS if not _which(d)]
    if missing:
        return f"Slurm or munge is not installed (missing {', '.join(missing)}; scripts/deps.sh installs slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs as their user; these tests run as uid %d" % os.geteuid()
    return None


class Cluster:
    def __init__(self, root):
        self.root = root
        self.procs = []
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(root, "slurm.conf")
        # Nothing of an outer Slurm job (a CI runner inside one) may leak in.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = self.conf

    def _log_tail(self, name, n=15):
        path = os.path.join(self.root, "log", name)
        try:
            with open(path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def start(self, timeout=40):
        """Starts munge, slurmctld and slurmd; returns None, or why the cluster did not come up."""
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
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        for _ in range(50):
            if os.path.exists(self.munge_socket):
                break
            time.sleep(0.1)
        else:
            return "munged did not create its socket: " + self._log_tail("munged.log")
        cpus = os.cpu_count() or 1
        r = self.root
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=pacertest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
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
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")
        self.procs.append(subprocess.Popen([_which("slurmctld"), "-D", "-i", "-f", self.conf], env=self.env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        self.procs.append(subprocess.Popen([_which("slurmd"), "-D", "-f", self.conf], env=self.env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        deadline = time.time() + timeout
        while time.time() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    return (f"{p.args[0]} exited with {p.returncode}: slurmctld.log: {self._log_tail('slurmctld.log')} "
                            f"slurmd.log: {self._log_tail('slurmd.log')}")
            s = subprocess.run([_which("sinfo"), "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if s.returncode == 0 and s.stdout.strip() == "idle":
                return None
            time.sleep(0.5)
        return (f"node not idle within {timeout} s: slurmctld.log: {self._log_tail('slurmctld.log')} "
                f"slurmd.log: {self._log_tail('slurmd.log')}")

    def stop(self):
        subprocess.run([_which("scancel"), "--user", "root"], env=self.env, capture_output=True)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

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
