"""pacer curate classify against fastText's own `fasttext predict`, and near-duplicate recall/precision.

Real text only: paragraphs of the Debian copyright files, Debian changelogs and section-1 manual pages
this machine ships (/usr/share/doc, /usr/share/man), each labelled by where it came from. fastText's CLI
trains the model on every other paragraph; both contenders then label every paragraph with it:
  - 1 core: `fasttext predict MODEL corpus.txt 1` vs `pacer curate classify ... --jobs 1`
  - N cores: fastText's predict is one thread, so its N-core run is N processes on N slices of the file,
    against `pacer curate classify --jobs N`.
Contenders alternate within each trial; wall time of each whole command (model load, parsing and output
included); medians with min and max. Predictions are compared label by label.
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


def timed(cmd, **kw):
    t = time.perf_counter()
    subprocess.run(cmd, check=True, **kw)
    return time.perf_counter() - t


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pacer", default=os.environ.get("PACER_BIN", os.path.join(ROOT, "build/bin/pacer")))
    ap.add_argument("--fasttext", default=shutil.which("fasttext") or "/usr/bin/fasttext")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--limit", type=int, default=200000)
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--planted", type=int, default=2000)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results"))
    ap.add_argument("--name", default="curate_vs_fasttext-" + datetime.date.today().isoformat())
    a = ap.parse_args()
    load_before = load()
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="pacer-curate-bench-")
    try:
        docs = corpus(a.limit)
        text_path, jsonl_path, train_path = (os.path.join(tmp, n) for n in ("corpus.txt", "corpus.jsonl", "train.txt"))
        with open(text_path, "w") as t, open(jsonl_path, "w") as j, open(train_path, "w") as tr:
            for i, (label, p) in enumerate(docs):
                t.write(p + "\n")
                j.write(json.dumps({"id": f"p{i}", "text": p}) + "\n")
                if i % 2 == 0:
                    tr.write(f"__label__{label} {p}\n")
        words_total = sum(len(p.split()) for _, p in docs)
        model = os.path.join(tmp, "model")
        subprocess.run([a.fasttext, "supervised", "-input", train_path, "-output", model, "-dim", "32", "-wordNgrams", "2", "-bucket", "200000",
                        "-epoch", "5", "-minCount", "1", "-thread", str(a.cores), "-verbose", "0"], check=True)
        model += ".bin"
        # The N-core peer: N slices of the file, one fastText process each.
        slices = []
        per = (len(docs) + a.cores - 1) // a.cores
        for k in range(a.cores):
            s = os.path.join(tmp, f"slice{k}.txt")
            with open(s, "w") as f:
                for _, p in docs[k * per:(k + 1) * per]:
                    f.write(p + "\n")
            slices.append(s)
        store_root = os.path.join(tmp, "stores")
        results = {"fasttext_1": [], "pacer_1": [], f"fasttext_{a.cores}": [], f"pacer_{a.cores}": []}
        agreement = None

        def pacer_run(jobs, trial):
            store = os.path.join(store_root, f"{jobs}-{trial}")
            v = json.loads(subprocess.run([a.pacer, "data", "add", jsonl_path, "--store", store, "--json"], check=True, capture_output=True,
                                          text=True).stdout)["version"]
            t = time.perf_counter()
            r = subprocess.run([a.pacer, "curate", "classify", v, "--model", f"source={model}", "--jobs", str(jobs), "--store", store, "--json"],
                               check=True, capture_output=True, text=True)
            return time.perf_counter() - t, json.loads(r.stdout), store

        for trial in range(a.trials):
            order = [0, 1] if trial % 2 == 0 else [1, 0]
            for who in order:
                if who == 0:
                    with open(os.devnull, "w") as null:
                        results["fasttext_1"].append(timed([a.fasttext, "predict", model, text_path, "1"], stdout=null))
                else:
                    dt, rep, store = pacer_run(1, trial)
                    results["pacer_1"].append(dt)
                    if agreement is None:
                        ft = subprocess.run([a.fasttext, "predict", model, text_path, "1"], check=True, capture_output=True, text=True).stdout.split()
                        ours = [json.loads(x) for x in open(os.path.join(tmp, "corpus.jsonl.scores", f"source-{rep['version']}.jsonl"))]
                        agreement = sum(1 for x, y in zip(ft, ours) if x == "__label__" + str(y)) / len(ft)
                    shutil.rmtree(store)
            for who in order:
                if who == 0:
                    t = time.perf_counter()
                    procs = [subprocess.Popen([a.fasttext, "predict", model, s, "1"], stdout=subprocess.DEVNULL) for s in slices]
                    for p in procs:
                        p.wait()
                    results[f"fasttext_{a.cores}"].append(time.perf_counter() - t)
                else:
                    dt, rep, store = pacer_run(a.cores, trial)
                    results[f"pacer_{a.cores}"].append(dt)
                    shutil.rmtree(store)
        tp = {k: {"samples_per_s": summary([len(docs) / x for x in v]), "seconds": summary(v)} for k, v in results.items()}
        ratio_1 = tp["pacer_1"]["samples_per_s"]["median"] / tp["fasttext_1"]["samples_per_s"]["median"]
        ratio_n = tp[f"pacer_{a.cores}"]["samples_per_s"]["median"] / tp[f"fasttext_{a.cores}"]["samples_per_s"]["median"]
        scaling = tp[f"pacer_{a.cores}"]["samples_per_s"]["median"] / tp["pacer_1"]["samples_per_s"]["median"]

        # Near duplicates.
        rng = random.Random(11)
        long_docs = [p for _, p in docs if len(p.split()) >= 60]
        base_path = os.path.join(tmp, "base.jsonl")
        with open(base_path, "w") as f:
            for i, p in enumerate(long_docs):
                f.write(json.dumps({"id": f"b{i}", "text": p}) + "\n")
        bstore = os.path.join(tmp, "bstore")
        bv = json.loads(subprocess.run([a.pacer, "curate", "dedup", base_path, "--store", bstore, "--json"], check=True, capture_output=True,
                                       text=True).stdout)["version"]
        col = json.loads(subprocess.run([a.pacer, "data", "log", bv, "--store", bstore, "--json"], check=True, capture_output=True,
                                        text=True).stdout)["lineage"][0]["columns"]["dup"]["files"][0]
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
                                        text=True).stdout)
        dedup_s = time.perf_counter() - t
        cols = json.loads(subprocess.run([a.pacer, "data", "log", rep["version"], "--store", nstore, "--json"], check=True, capture_output=True,
                                         text=True).stdout)["lineage"][0]["columns"]
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
        uptime_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
        out = {
            "schema": "pacer.bench.curate_vs_fasttext/1",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"host": platform.node(), "cpu": cpu, "cpus": len(os.sched_getaffinity(0)), "kernel": platform.release()},
            "load_before": load_before, "load_after": load_after, "uptime_before": uptime_before, "uptime_after": uptime_after,
            "command": "bench/curate_vs_fasttext.sh " + " ".join(sys.argv[1:]),
            "corpus": {"paragraphs": len(docs), "words": words_total, "sources": "/usr/share/doc/*/copyright, changelog.Debian.gz, /usr/share/man/man1"},
            "model": {"trained_by": "fasttext supervised -dim 32 -wordNgrams 2 -bucket 200000 -epoch 5 -minCount 1", "labels": 3},
            "trials": a.trials, "cores": a.cores, "throughput": tp,
            "pacer_vs_fasttext_1_core": ratio_1, f"pacer_vs_fasttext_{a.cores}_cores": ratio_n, f"pacer_scaling_1_to_{a.cores}": scaling,
            "label_agreement_with_fasttext": agreement,
            "near_dup": {"threshold": threshold, "shingle": rep["parameters"]["shingle"], "bands": rep["parameters"]["bands"],
                         "rows": rep["parameters"]["rows"], "samples": len(rows), "planted_pairs": len(planted), "distractors": len(distractors),
                         "natural_duplicates_removed": sum(1 for d in natural if d), "flagged": len(flagged), "precision": precision,
                         "recall_by_true_jaccard": recall, "seconds": dedup_s},
        }
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, a.name + ".json"), "w") as f:
            json.dump(out, f, indent=2)
        md = [f"# pacer curate classify vs fasttext predict, near-dup recall ({out['date']})", "",
              f"Machine: {cpu}, {out['machine']['cpus']} CPUs. Load before: {uptime_before}; after: {uptime_after}.",
              f"Corpus: {len(docs)} paragraphs ({words_total} words) of Debian copyright files, changelogs and man pages; 3 labels.", "",
              "| contender | samples/s median | min | max |", "|---|---|---|---|"]
        for k, v in tp.items():
            s = v["samples_per_s"]
            md.append(f"| {k.replace('_', ' on ')} core(s) | {s['median']:.0f} | {s['min']:.0f} | {s['max']:.0f} |")
        md += ["", f"pacer / fasttext: {ratio_1:.2f}x on 1 core, {ratio_n:.2f}x on {a.cores}; pacer scaling 1 -> {a.cores} cores: {scaling:.2f}x.",
               f"Labels identical to fasttext predict's: {100 * agreement:.2f}%.", "",
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
