"""Kiln before (0c3e791, this issue's base) and after, as benchmarks/cpu_seam.py measures a variant: a fresh
process's first step, cold then warm from Kiln's cache, each in its own folders, alternating."""
import json, os, shutil, statistics, subprocess, sys, tempfile, time
CODE = {"before (0c3e791)": "/tmp/basepkg", "after": "/work/main/.."}
def child(code, run, cache, inductor, temp):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, TMPDIR=temp)
    if code.startswith("before"):
        env["PYTHONPATH"] = CODE[code]
    cmd = [sys.executable, "-m", "kiln.benchmarks.cache_bench", "--child", run, "--model", "sd15", "--size", "cpu",
           "--device", "cpu", "--dtype", "fp32", "--batch", "2", "--mode", "balanced", "--cache-dir", cache]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return dict(r, code=code)
rows = []
order = list(CODE)
for rnd in range(3):
    for code in order if rnd % 2 == 0 else order[::-1]:
        work = tempfile.mkdtemp()
        dirs = [os.path.join(work, n) for n in ("kiln-cache", "inductor", "temp")]
        os.makedirs(dirs[2], mode=0o700)
        for run in ("kiln cold", "kiln warm"):
            r = dict(child(code, run, *dirs), round=rnd)
            rows.append(r)
            print(f"round {rnd + 1}, {code}, {run}: first step {r['first_step_s']:.1f}s", file=sys.stderr, flush=True)
        shutil.rmtree(work, ignore_errors=True)
summary = {run: {code: statistics.median(r["first_step_s"] for r in rows if r["code"] == code and r["run"] == run)
                 for code in CODE} for run in ("kiln cold", "kiln warm")}
print(json.dumps({"method": __doc__, "rows": rows, "summary": summary}, indent=2))
