"""Kiln before (0c3e791, issue 56's base) and after, measured as benchmarks/cpu_seam.py measures a
variant: a fresh process's first step (kiln bench --cache's Kiln child), cold then warm from Kiln's
cache, each in its own folders, the two trees alternating, 3 rounds.

    git worktree add ../kiln-before 0c3e791
    python cpu-seam-2026-12-02-sd15-before-after.py ../kiln-before > results.json 2> results.log

run from the after checkout (the installed `kiln`); the before tree is put on PYTHONPATH as `kiln`."""
import json, os, shutil, statistics, subprocess, sys, tempfile

before_tree = os.path.abspath(sys.argv[1])
shadow = tempfile.mkdtemp()
os.symlink(before_tree, os.path.join(shadow, "kiln"))  # `import kiln` finds the before tree first
CODE = {"before (0c3e791)": shadow, "after": None}


def child(code, run, cache, inductor, temp):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, TMPDIR=temp)
    if CODE[code]:
        env["PYTHONPATH"] = CODE[code]
    cmd = [sys.executable, "-m", "kiln.benchmarks.cache_bench", "--child", run, "--model", "sd15", "--size", "cpu",
           "--device", "cpu", "--dtype", "fp32", "--batch", "2", "--mode", "balanced", "--cache-dir", cache]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), code=code)


rows = []
order = list(CODE)
for rnd in range(3):
    for code in order if rnd % 2 == 0 else order[::-1]:
        work = tempfile.mkdtemp()
        dirs = [os.path.join(work, n) for n in ("kiln-cache", "inductor", "temp")]
        os.makedirs(dirs[2], mode=0o700)
        for run in ("kiln cold", "kiln warm"):
            row = dict(child(code, run, *dirs), round=rnd)
            rows.append(row)
            print(f"round {rnd + 1}, {code}, {run}: first step {row['first_step_s']:.1f}s", file=sys.stderr, flush=True)
        shutil.rmtree(work, ignore_errors=True)
summary = {run: {code: statistics.median(r["first_step_s"] for r in rows if r["code"] == code and r["run"] == run)
                 for code in CODE} for run in ("kiln cold", "kiln warm")}
print(json.dumps({"method": __doc__, "rows": rows, "summary": summary}, indent=2))
