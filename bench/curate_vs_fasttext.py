"""pacer curate classify against fastText's own `fasttext predict`, and near-duplicate recall/precision.

Real text only: paragraphs of the Debian copyright files, Debian changelogs and section-1 manual pages
this machine ships (/usr/share/doc, /usr/share/man), each labelled by where it came from; or the same
paragraphs saved on a Debian machine (--save-corpus) and read elsewhere (--corpus), for a host without
them (bench/device/curate_many_cores.sh). fastText's CLI trains the model on every other paragraph; both
contenders then label every paragraph with it, at each core count N of --cores:
  - 1 core: `fasttext predict MODEL corpus.txt 1` vs `pacer curate classify ... --jobs 1`
  - N cores: fastText's predict is one thread, so its N-core run is N processes on N slices of the file,
    against `pacer curate classify --jobs N`; per core, pacer's N-core rate is also set against N times
    fastText's measured 1-core rate (derived, not a run).
Contenders alternate within each trial; wall time of each whole command (model load, parsing and output
included); medians with min and max; also the CPU time of each (user + system, of the waited-for
processes), which a shared machine disturbs far less than wall time. Predictions are compared label by
label at every N (the N-thread column must keep the rows' order). --repeat K labels the corpus K times over (real text still; for many
cores, where one pass takes too little time next to loading the model).
Near duplicates: paragraphs of at least 60 words, natural duplicates removed, each planted once more with
1 to 3 words replaced (and sometimes one deleted); recall and precision of `pacer curate dedup` at its
documented threshold, by the pair's true Jaccard similarity of 5-word shingles.
"""
import argparse
import datetime
import gzip
import json
import os
import platform
import random
import resource
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORD = re.compile(rb"[A-Za-z0-9\x80-\xff]+")


def words(text):
    return [w.lower() for w in WORD.findall(text.encode("utf-8", "replace"))]


def shingles(text, n=5):
    w = words(text)
    if len(w) < n:
        return {tuple(w)} if w else set()
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def paragraphs(text):
    for p in re.split(r"\n\s*\n", text):
        p = " ".join(p.split())
        if len(p.split()) >= 8:
            yield p


def read(path):
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rt", errors="replace") as f:
                return f.read()
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def strip_roff(text):
    out = []
    for line in text.splitlines():
        if line.startswith((".", "'")):
            if line[:3] in (".PP", ".SH", ".TP", ".LP", ".IP", ".SS"):
                out.append("")
            continue
        line = re.sub(r"\\f[BIRP]|\\f\(..|\\\(..|\\[-e&|^]|\\s[+-]?\d", "", line)
        out.append(line)
    return "\n".join(out)


def corpus(limit):
    docs = []
    for d in sorted(os.listdir("/usr/share/doc")):
        base = os.path.join("/usr/share/doc", d)
        for p in paragraphs(read(os.path.join(base, "copyright"))):
            docs.append(("copyright", p))
        for p in paragraphs(read(os.path.join(base, "changelog.Debian.gz"))):
            docs.append(("changelog", p))
    man = "/usr/share/man/man1"
    for name in sorted(os.listdir(man)):
        for p in paragraphs(strip_roff(read(os.path.join(man, name)))):
            docs.append(("manual", p))
    seen, unique = set(), []
    for label, p in docs:
        if p not in seen:
            seen.add(p)
            unique.append((label, p))
    random.Random(7).shuffle(unique)
    return unique[:limit]


def load():
    return os.getloadavg()


def uptime():
    # Not every host has procps (the GPU machine's image may not): the load averages then.
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def save_corpus(docs, path):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for label, p in docs:
            f.write(f"{label}\t{p}\n")


def load_corpus(path, limit):
    docs = []
    with (gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")) as f:
        for line in f:
            label, p = line.rstrip("\n").split("\t", 1)
            docs.append((label, p))
    return docs[:limit]


def children_cpu():
    # User and system seconds of the waited-for children: on a shared machine a contender's CPU time
    # moves far less than its wall time.
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pacer", default=os.environ.get("PACER_BIN", os.path.join(ROOT, "build/bin/pacer")))
    ap.add_argument("--fasttext", default=shutil.which("fasttext") or "/usr/bin/fasttext")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--limit", type=int, default=200000)
    ap.add_argument("--cores", default=str(len(os.sched_getaffinity(0))),
                    help="N (1 and N cores) or a list N1,N2,... of core counts (1 is always added)")
    ap.add_argument("--corpus", help="labelled paragraphs saved by --save-corpus (label TAB paragraph, gzip or plain), instead of /usr/share")
    ap.add_argument("--save-corpus", help="write this machine's corpus to this file (gzip) and exit")
    ap.add_argument("--repeat", type=int, default=1, help="label the corpus this many times over")
    ap.add_argument("--note", default="", help="a line on the conditions (a shared machine, who else ran), kept in both result files")
    ap.add_argument("--lib-path", default=os.environ.get("PACER_BENCH_LIB_PATH"),
                    help="LD_LIBRARY_PATH for pacer and fasttext only (carried libraries; Python keeps its own)")
    ap.add_argument("--planted", type=int, default=2000)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results"))
    ap.add_argument("--name", default="curate_vs_fasttext-" + datetime.date.today().isoformat())
    a = ap.parse_args()
    cores = sorted({1} | {int(x) for x in str(a.cores).split(",") if x.strip()})
    tool_env = dict(os.environ)
    if a.lib_path:
        tool_env["LD_LIBRARY_PATH"] = a.lib_path + (":" + tool_env["LD_LIBRARY_PATH"] if tool_env.get("LD_LIBRARY_PATH") else "")
    if a.save_corpus:
        docs = corpus(a.limit)
        save_corpus(docs, a.save_corpus)
        print(f"{a.save_corpus}: {len(docs)} paragraphs")
        return
    load_before = load()
    uptime_before = uptime()
    tmp = tempfile.mkdtemp(prefix="pacer-curate-bench-")
    try:
        docs = load_corpus(a.corpus, a.limit) if a.corpus else corpus(a.limit)
        labelled = docs * a.repeat
        text_path, jsonl_path, train_path = (os.path.join(tmp, n) for n in ("corpus.txt", "corpus.jsonl", "train.txt"))
        with open(text_path, "w") as t, open(jsonl_path, "w") as j, open(train_path, "w") as tr:
            for i, (label, p) in enumerate(labelled):
                t.write(p + "\n")
                j.write(json.dumps({"id": f"p{i}", "text": p}) + "\n")
                if i % 2 == 0 and i < len(docs):
                    tr.write(f"__label__{label} {p}\n")
        words_total = sum(len(p.split()) for _, p in labelled)
        model = os.path.join(tmp, "model")
        subprocess.run([a.fasttext, "supervised", "-input", train_path, "-output", model, "-dim", "32", "-wordNgrams", "2", "-bucket", "200000",
                        "-epoch", "5", "-minCount", "1", "-thread", str(max(cores)), "-verbose", "0"], check=True, env=tool_env)
        model += ".bin"
        ft_labels = subprocess.run([a.fasttext, "predict", model, text_path, "1"], check=True, capture_output=True, text=True,
                                   env=tool_env).stdout.split()
        # The N-core peer: N slices of the file, one fastText process each.
        slices = {}
        for n in cores:
            per = (len(labelled) + n - 1) // n
            slices[n] = []
            for k in range(n):
                s = os.path.join(tmp, f"slice{n}-{k}.txt")
                with open(s, "w") as f:
                    for _, p in labelled[k * per:(k + 1) * per]:
                        f.write(p + "\n")
                slices[n].append(s)
        store_root = os.path.join(tmp, "stores")
        results = {f"{who}_{n}": [] for n in cores for who in ("fasttext", "pacer")}
        cpu = {k: [] for k in results}
        agreement = {}

        def pacer_run(jobs, trial):
            store = os.path.join(store_root, f"{jobs}-{trial}")
            v = json.loads(subprocess.run([a.pacer, "data", "add", jsonl_path, "--store", store, "--json"], check=True, capture_output=True,
                                          text=True, env=tool_env).stdout)["version"]
            c = children_cpu()
            t = time.perf_counter()
            r = subprocess.run([a.pacer, "curate", "classify", v, "--model", f"source={model}", "--jobs", str(jobs), "--store", store, "--json"],
                               check=True, capture_output=True, text=True, env=tool_env)
            cpu[f"pacer_{jobs}"].append(children_cpu() - c)
            return time.perf_counter() - t, json.loads(r.stdout), store

        for trial in range(a.trials):
            order = [0, 1] if trial % 2 == 0 else [1, 0]
            for n in cores:
                for who in order:
                    if who == 0:
                        c = children_cpu()
                        t = time.perf_counter()
                        procs = [subprocess.Popen([a.fasttext, "predict", model, s, "1"], stdout=subprocess.DEVNULL, env=tool_env) for s in slices[n]]
                        for p in procs:
                            p.wait()
                            if p.returncode:
                                raise SystemExit(f"fasttext predict exited with {p.returncode}")
                        results[f"fasttext_{n}"].append(time.perf_counter() - t)
                        cpu[f"fasttext_{n}"].append(children_cpu() - c)
                    else:
                        dt, rep, store = pacer_run(n, trial)
                        results[f"pacer_{n}"].append(dt)
                        if n not in agreement:
                            ours = [json.loads(x) for x in open(os.path.join(tmp, "corpus.jsonl.scores", f"source-{rep['version']}.jsonl"))]
                            same = sum(1 for x, y in zip(ft_labels, ours) if x == "__label__" + str(y))
                            agreement[n] = same / len(ft_labels) if len(ours) == len(ft_labels) else 0.0
                        shutil.rmtree(store)
                print(f"trial {trial + 1}/{a.trials}, {n} core(s): fasttext {results[f'fasttext_{n}'][-1]:.2f} s, "
                      f"pacer {results[f'pacer_{n}'][-1]:.2f} s", file=sys.stderr, flush=True)
        tp = {k: {"samples_per_s": summary([len(labelled) / x for x in v]), "seconds": summary(v),
                  "samples_per_cpu_s": summary([len(labelled) / x for x in cpu[k]]), "cpu_seconds": summary(cpu[k])} for k, v in results.items()}
        per_cpu = {k: v["samples_per_cpu_s"]["median"] for k, v in tp.items()}
        rate = {k: v["samples_per_s"]["median"] for k, v in tp.items()}
        by_cores = {n: {"pacer_vs_fasttext_processes": rate[f"pacer_{n}"] / rate[f"fasttext_{n}"],
                        "pacer_vs_n_times_fasttext_1_core": rate[f"pacer_{n}"] / (n * rate["fasttext_1"]),
                        "pacer_scaling_from_1": rate[f"pacer_{n}"] / rate["pacer_1"],
                        "fasttext_scaling_from_1": rate[f"fasttext_{n}"] / rate["fasttext_1"],
                        "pacer_vs_fasttext_per_cpu_second": per_cpu[f"pacer_{n}"] / per_cpu[f"fasttext_{n}"],
                        "label_agreement_with_fasttext": agreement[n]} for n in cores}
        top = max(cores)
        ratio_1 = by_cores[1]["pacer_vs_fasttext_processes"]
        ratio_n = by_cores[top]["pacer_vs_fasttext_processes"]
        scaling = by_cores[top]["pacer_scaling_from_1"]

        # Near duplicates.
        rng = random.Random(11)
        long_docs = [p for _, p in docs if len(p.split()) >= 60]
        base_path = os.path.join(tmp, "base.jsonl")
        with open(base_path, "w") as f:
            for i, p in enumerate(long_docs):
                f.write(json.dumps({"id": f"b{i}", "text": p}) + "\n")
        bstore = os.path.join(tmp, "bstore")
        bv = json.loads(subprocess.run([a.pacer, "curate", "dedup", base_path, "--store", bstore, "--json"], check=True, capture_output=True,
                                       text=True, env=tool_env).stdout)["version"]
        col = json.loads(subprocess.run([a.pacer, "data", "log", bv, "--store", bstore, "--json"], check=True, capture_output=True,
                                        text=True, env=tool_env).stdout)["lineage"][0]["columns"]["dup"]["files"][0]
        natural = [json.loads(x) for x in open(col)]
        clean = [p for p, d in zip(long_docs, natural) if d is False]
        vocab = sorted({w for p in clean[:5000] for w in p.split()})
        originals = clean[:a.planted]
        distractors = clean[a.planted:a.planted * 2]
        planted = []
        for i, p in enumerate(originals):
            w = p.split()
            for _ in range(rng.randint(1, 3)):
                w[rng.randrange(len(w))] = rng.choice(vocab)
            if rng.random() < 0.3:
                del w[rng.randrange(len(w))]
            q = " ".join(w)
            sa, sb = shingles(p), shingles(q)
            planted.append((i, q, len(sa & sb) / len(sa | sb)))
        rows = [{"id": f"o{i}", "text": p} for i, p in enumerate(originals)]
        mixed = [{"id": f"c{i}", "text": q, "j": j} for i, q, j in planted] + [{"id": f"d{i}", "text": p} for i, p in enumerate(distractors)]
        rng.shuffle(mixed)
        rows += mixed
        nd_path = os.path.join(tmp, "planted.jsonl")
        with open(nd_path, "w") as f:
            for r in rows:
                f.write(json.dumps({"id": r["id"], "text": r["text"]}) + "\n")
        nstore = os.path.join(tmp, "nstore")
        t = time.perf_counter()
        rep = json.loads(subprocess.run([a.pacer, "curate", "dedup", nd_path, "--store", nstore, "--json"], check=True, capture_output=True,
                                        text=True, env=tool_env).stdout)
        dedup_s = time.perf_counter() - t
        cols = json.loads(subprocess.run([a.pacer, "data", "log", rep["version"], "--store", nstore, "--json"], check=True, capture_output=True,
                                         text=True, env=tool_env).stdout)["lineage"][0]["columns"]
        dup = [json.loads(x) for x in open(cols["dup"]["files"][0])]
        dup_of = [json.loads(x) for x in open(cols["dup_of"]["files"][0])]
        threshold = rep["parameters"]["threshold"]
        flagged = [(r, of) for r, d, of in zip(rows, dup, dup_of) if d]
        right = sum(1 for r, of in flagged if r["id"].startswith("c") and of == "o" + r["id"][1:])
        precision = right / len(flagged) if flagged else 1.0
        bins = {"[0.80,0.85)": (0.80, 0.85), "[0.85,0.90)": (0.85, 0.90), "[0.90,1.00]": (0.90, 1.01), ">=0.80": (0.80, 1.01),
                "[0.70,0.80)": (0.70, 0.80), "<0.70": (0.0, 0.70)}
        hit = {r["id"] for r, of in flagged if r["id"].startswith("c") and of == "o" + r["id"][1:]}
        recall = {}
        for name, (lo, hi) in bins.items():
            ids = [f"c{i}" for i, _, j in planted if lo <= j < hi]
            recall[name] = {"pairs": len(ids), "recall": (sum(1 for x in ids if x in hit) / len(ids)) if ids else None}
        load_after = load()
        uptime_after = uptime()
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
        out = {
            "schema": "pacer.bench.curate_vs_fasttext/1",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"host": platform.node(), "cpu": cpu, "cpus": len(os.sched_getaffinity(0)), "kernel": platform.release()},
            "load_before": load_before, "load_after": load_after, "uptime_before": uptime_before, "uptime_after": uptime_after,
            "command": "bench/curate_vs_fasttext.sh " + " ".join(sys.argv[1:]), "note": a.note,
            "corpus": {"paragraphs": len(docs), "repeat": a.repeat, "samples": len(labelled), "words": words_total,
                       "sources": "/usr/share/doc/*/copyright, changelog.Debian.gz, /usr/share/man/man1",
                       "read_from": os.path.abspath(a.corpus) if a.corpus else "this machine's /usr/share"},
            "model": {"trained_by": "fasttext supervised -dim 32 -wordNgrams 2 -bucket 200000 -epoch 5 -minCount 1", "labels": 3},
            "trials": a.trials, "cores": top, "core_counts": cores, "throughput": tp, "by_cores": {str(n): v for n, v in by_cores.items()},
            "pacer_vs_fasttext_1_core": ratio_1, f"pacer_vs_fasttext_{top}_cores": ratio_n, f"pacer_scaling_1_to_{top}": scaling,
            "label_agreement_with_fasttext": min(agreement.values()),
            "near_dup": {"threshold": threshold, "shingle": rep["parameters"]["shingle"], "bands": rep["parameters"]["bands"],
                         "rows": rep["parameters"]["rows"], "samples": len(rows), "planted_pairs": len(planted), "distractors": len(distractors),
                         "natural_duplicates_removed": sum(1 for d in natural if d), "flagged": len(flagged), "precision": precision,
                         "recall_by_true_jaccard": recall, "seconds": dedup_s},
        }
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, a.name + ".json"), "w") as f:
            json.dump(out, f, indent=2)
        md = [f"# pacer curate classify vs fasttext predict, near-dup recall ({out['date']})", "",
              f"Machine: {cpu}, {out['machine']['cpus']} CPUs. Load before: {uptime_before}; after: {uptime_after}."
              + (f" {a.note}" if a.note else ""),
              f"Corpus: {len(docs)} paragraphs of Debian copyright files, changelogs and man pages"
              + (f", labelled {a.repeat} times over ({len(labelled)} samples)" if a.repeat > 1 else "")
              + f" ({words_total} words); 3 labels; read from {out['corpus']['read_from']}. {a.trials} trials, contenders alternated.", "",
              "| contender | samples/s median | min | max | samples per CPU-second, median | min | max |", "|---|---|---|---|---|---|---|"]
        for k, v in tp.items():
            s, c = v["samples_per_s"], v["samples_per_cpu_s"]
            md.append(f"| {k.replace('_', ' on ')} core(s) | {s['median']:.0f} | {s['min']:.0f} | {s['max']:.0f} | "
                      f"{c['median']:.0f} | {c['min']:.0f} | {c['max']:.0f} |")
        md += ["", "| cores | pacer / N fasttext processes | pacer / (N x fasttext on 1 core) | pacer scaling | fasttext scaling "
               "| pacer / fasttext per CPU-second | labels identical |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for n, v in by_cores.items():
            md.append(f"| {n} | {v['pacer_vs_fasttext_processes']:.2f} | {v['pacer_vs_n_times_fasttext_1_core']:.2f} | {v['pacer_scaling_from_1']:.2f} | "
                      f"{v['fasttext_scaling_from_1']:.2f} | {v['pacer_vs_fasttext_per_cpu_second']:.2f} | "
                      f"{100 * v['label_agreement_with_fasttext']:.2f}% |")
        md += ["", f"pacer / fasttext: {ratio_1:.2f}x on 1 core, {ratio_n:.2f}x on {top}; pacer scaling 1 -> {top} cores: {scaling:.2f}x.",
               f"Labels identical to fasttext predict's: {100 * min(agreement.values()):.2f}% (the lowest over the core counts).", "",
               f"Near duplicates (Jaccard >= {threshold}, 5-word shingles, {rep['parameters']['bands']} bands x {rep['parameters']['rows']} rows): "
               f"{len(planted)} planted pairs among {len(rows)} samples; precision {precision:.4f}.", "", "| true Jaccard | pairs | recall |", "|---|---|---|"]
        for k, v in recall.items():
            cell = "-" if v["recall"] is None else f"{v['recall']:.4f}"
            md.append(f"| {k} | {v['pairs']} | {cell} |")
        with open(os.path.join(a.out, a.name + ".md"), "w") as f:
            f.write("\n".join(md) + "\n")
        print("\n".join(md))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
