"""A ComfyUI bundle for a CUDA machine without network access: a trimmed ComfyUI tree and the wheels
that machine lacks, checked against the size a run may carry (MAX_BUNDLE_MIB, counting the repository's
own files that travel with it), with a manifest of what is in it.

    python -m kiln.benchmarks.comfy_bundle --comfyui PATH --out DIR [--versions-from PYTHON] [--no-wheels]

DIR gets:
- comfyui.tar.xz: the tree under ComfyUI/, only what a headless ComfyUI needs to start in process and
  as an API server (the Python packages and modules, its database migrations, requirements.txt,
  pyproject.toml, LICENSE); DROPPED_DIRS and every other top-level file are left out, and so are
  byte-code caches;
- wheels/: for each of ComfyUI's requirements that the machine lacks (cuda_machine_packages.txt, or
  --target-packages), and for what those need in turn, one wheel for CPython 3.12 on manylinux x86_64,
  fetched with `pip download` at the version the requirement pins, else the one installed for
  --versions-from's Python (the ComfyUI this tree runs with here), else the newest that fits;
  HEADLESS_UNNEEDED and the requirements ComfyUI lists as non-essential (but NON_ESSENTIAL_FETCHED)
  are not fetched;
  PURE_WHEELS are fetched as their pure-Python wheel;
- manifest.json: every file of the tree with its size, each wheel with its version, size and the
  requirement it serves, what was left out and why, the sizes and the limit.

Exit status 1, naming the biggest parts, when the bundle and the repository together pass the limit.
On the CUDA machine: benchmarks/gpu_session.sh comfyui (docs/comfyui-gpu.md).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

MAX_BUNDLE_MIB = 64   # what one run on the CUDA machine carries: the repository's files and the bundle together
REPO = Path(__file__).resolve().parents[1]
TARGET_PACKAGES = Path(__file__).with_name("cuda_machine_packages.txt")
ARCHIVE = "comfyui.tar.xz"
TREE_ROOT = "ComfyUI"

# Top-level folders of a ComfyUI tree that a headless API server does not need.
DROPPED_DIRS = {
    "tests": "ComfyUI's own tests", "tests-unit": "ComfyUI's own tests", "script_examples": "examples",
    "models": "model folders (the runner writes its checkpoints into a base directory of its own)",
    "input": "a run's files", "output": "a run's files", "temp": "a run's files", "user": "a run's files",
    "custom_nodes": "node packs (the runner links Kiln in through its base directory)",
    "blueprints": "the web frontend's subgraph blueprints", "web": "the web frontend",
    "notebooks": "notebooks", ".git": "version control", ".github": "CI", ".ci": "CI",
}
KEPT_TOP_FILES = {"alembic.ini", "requirements.txt", "pyproject.toml", "LICENSE"}   # and every top-level *.py
EMPTY_DIRS = ("custom_nodes", "web")   # created empty: where ComfyUI looks for node packs; the --front-end-root
HEADLESS_UNNEEDED = {
    "comfyui-frontend-package": "the web frontend: a headless server runs with --front-end-root on the empty web/",
    "comfyui-workflow-templates": "the frontend's template browser",
    "comfyui-embedded-docs": "the frontend's node documentation",
}
PURE_WHEELS = {
    "comfy-kitchen": "its CUDA and ROCm backends are 56 MB compressed; the pure wheel runs its eager and Triton "
                     "backends",
}
NON_ESSENTIAL_FETCHED = {   # of the requirements ComfyUI calls non-essential, those the examples or a node pack use
    "kornia": "Canny (the ControlNet examples) and the latent and post-processing nodes",
    "pydantic": "ComfyUI's reading of a node pack's pyproject.toml",
    "pydantic-settings": "ComfyUI's reading of a node pack's pyproject.toml",
    "spandrel": "the upscale-model nodes",
}
NON_ESSENTIAL_MARK = "non essential"   # requirements.txt's comment before the requirements ComfyUI runs without
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")
PYTHON_VERSION = "3.12"
MARKER_ENV = {"python_version": PYTHON_VERSION, "python_full_version": "3.12.3", "platform_system": "Linux",
              "sys_platform": "linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
MAX_WHEEL_ROUNDS = 8   # requirement depth followed before giving up (a cycle or a runaway tree)


class BundleError(RuntimeError):
    """The bundle cannot be made or does not fit: the message names what and why."""


@dataclass(frozen=True)
class Wanted:
    """A package the machine lacks: `spec` is what pip is asked for; `serves` the requirement it is for."""
    name: str
    spec: str
    serves: str


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    file: str
    bytes: int
    serves: str


def target_packages(path: Path) -> set[str]:
    """Canonical names from a file of one name a line (`name==version` and comments allowed)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canonicalize_name(re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0]))
    return names


def read_requirements(tree: Path) -> tuple[list[Requirement], list[Requirement]]:
    """(essential, non-essential) requirements of a ComfyUI tree's requirements.txt."""
    path = tree / "requirements.txt"
    if not path.is_file():
        raise BundleError(f"{tree}: no requirements.txt: not a ComfyUI tree")
    essential, optional = [], []
    section = essential
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if line.startswith("#"):
            if NON_ESSENTIAL_MARK in line.lower():
                section = optional
            continue
        if not line:
            continue
        try:
            section.append(Requirement(line))
        except InvalidRequirement as error:
            raise BundleError(f"requirements.txt line {number}: {error}") from None
    return essential, optional


def installed_versions(python: str | None) -> dict[str, str]:
    """{canonical name: version} of the packages `python` has (none without one)."""
    if not python:
        return {}
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise BundleError(f"--versions-from {python}: {done.stderr.strip()[-500:]}")
    return {canonicalize_name(name): version for name, version in json.loads(done.stdout).items()}


def pinned_spec(req: Requirement, versions: dict[str, str]) -> str:
    """What pip is asked for: the requirement's own pin, else the version installed here if it fits the
    requirement, else the requirement as written (pip takes the newest that fits)."""
    name = canonicalize_name(req.name)
    if any(s.operator in ("==", "===") for s in req.specifier):
        return f"{name}{req.specifier}"
    have = versions.get(name)
    if have and req.specifier.contains(have, prereleases=True):
        return f"{name}=={have}"
    return f"{name}{req.specifier}"


def wanted_from_requirements(tree: Path, have: set[str], versions: dict[str, str]) -> tuple[list[Wanted], dict]:
    """The requirements the machine lacks, and {name: why not fetched} for those left out."""
    essential, optional = read_requirements(tree)
    skipped = {canonicalize_name(r.name): "non-essential (requirements.txt)" for r in optional
               if canonicalize_name(r.name) not in have and canonicalize_name(r.name) not in NON_ESSENTIAL_FETCHED}
    wanted = []
    for req in essential + [r for r in optional if canonicalize_name(r.name) in NON_ESSENTIAL_FETCHED]:
        name = canonicalize_name(req.name)
        if name in have or (req.marker and not req.marker.evaluate(MARKER_ENV)):
            continue
        if name in HEADLESS_UNNEEDED:
            skipped[name] = HEADLESS_UNNEEDED[name]
            continue
        wanted.append(Wanted(name, pinned_spec(req, versions), str(req)))
    return wanted, skipped


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The Requires-Dist of a wheel that apply on the machine (no extras)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or Marker(str(req.marker)).evaluate(MARKER_ENV):
            out.append(req)
    return out


def wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return canonicalize_name(name), version


def pip_download(specs: list[str], folder: Path, pure: bool) -> None:
    platforms = ("any",) if pure else PLATFORMS
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               PYTHON_VERSION, "--implementation", "cp", "--disable-pip-version-check", "-q", "-d", str(folder)]
    for platform in platforms:
        command += ["--platform", platform]
    done = subprocess.run(command + specs, capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "ERROR" in line] or done.stderr.splitlines()[-5:]
        raise BundleError(f"pip download {' '.join(specs)}: " + " | ".join(errors))


def fetch_wheels(wanted: list[Wanted], folder: Path, have: set[str], versions: dict[str, str]) -> list[Wheel]:
    """Each wanted package's wheel and, round by round, those its wheel requires that the machine lacks."""
    folder.mkdir(parents=True, exist_ok=True)
    serves, fetched = {}, {}
    for _ in range(MAX_WHEEL_ROUNDS):
        todo = [w for w in wanted if w.name not in fetched]
        if not todo:
            break
        for pure in (False, True):
            specs = [w.spec for w in todo if (w.name in PURE_WHEELS) == pure]
            if specs:
                pip_download(specs, folder, pure)
        for w in todo:
            serves[w.name] = w.serves
        new = []
        for path in sorted(folder.glob("*.whl")):
            name, _ = wheel_name_version(path)
            if name in fetched:
                continue
            fetched[name] = path
            for req in wheel_requirements(path):
                dep = canonicalize_name(req.name)
                if dep not in have and dep not in fetched and all(w.name != dep for w in wanted + new):
                    new.append(Wanted(dep, pinned_spec(req, versions), f"{req} (needed by {name})"))
        wanted = wanted + new
    else:
        raise BundleError(f"wheels: still missing after {MAX_WHEEL_ROUNDS} rounds: "
                          f"{', '.join(w.name for w in wanted if w.name not in fetched)}")
    names = [wheel_name_version(path)[0] for path in folder.glob("*.whl")]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise BundleError(f"wheels: two versions of {', '.join(sorted(dupes))} in {folder}: keep one")
    return [Wheel(name, wheel_name_version(path)[1], path.name, path.stat().st_size,
                  serves.get(name, "already in the folder"))
            for name, path in sorted(fetched.items())]


def tree_files(tree: Path) -> tuple[list[Path], dict[str, str]]:
    """The files of `tree` the bundle keeps (relative paths), and {top-level entry: why left out}."""
    kept, dropped = [], {}
    for entry in sorted(tree.iterdir()):
        if entry.is_dir():
            if entry.name in DROPPED_DIRS or entry.name.startswith("."):
                dropped[entry.name + "/"] = DROPPED_DIRS.get(entry.name, "hidden")
                continue
            kept += [p.relative_to(tree) for p in sorted(entry.rglob("*"))
                     if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
        elif entry.suffix == ".py" or entry.name in KEPT_TOP_FILES:
            kept.append(entry.relative_to(tree))
        else:
            dropped[entry.name] = "not needed to run (documents, examples, settings of other tools)"
    return kept, dropped


def comfyui_version(tree: Path) -> str:
    match = re.search(r'__version__\s*=\s*"([^"]+)"', (tree / "comfyui_version.py").read_text()) \
        if (tree / "comfyui_version.py").is_file() else None
    return match.group(1) if match else "unknown"


def write_archive(tree: Path, files: list[Path], archive: Path) -> None:
    with tarfile.open(archive, "w:xz") as tar:
        for name in EMPTY_DIRS:
            info = tarfile.TarInfo(f"{TREE_ROOT}/{name}")
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for rel in files:
            tar.add(tree / rel, arcname=f"{TREE_ROOT}/{rel.as_posix()}", recursive=False)


def repository_bytes(repo: Path = REPO) -> int:
    """What the repository's tracked files weigh (they travel with the bundle); 0 outside a git checkout."""
    done = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], capture_output=True)
    if done.returncode != 0:
        return 0
    return sum((repo / name).stat().st_size for name in done.stdout.decode().split("\0")
               if name and (repo / name).is_file())


def check_size(parts: dict[str, int], limit: int) -> None:
    """BundleError naming the five biggest parts when they add up to more than `limit` bytes."""
    total = sum(parts.values())
    if total > limit:
        biggest = sorted(parts.items(), key=lambda kv: -kv[1])[:5]
        raise BundleError(f"the bundle and the repository take {total / 2**20:.1f} MiB, over the "
                          f"{limit / 2**20:.0f} MiB a run carries; biggest: "
                          + ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in biggest))


def assemble(comfyui: Path, out: Path, *, wheels: bool = True, versions_from: str | None = None,
             target: Path = TARGET_PACKAGES, limit_mib: float = MAX_BUNDLE_MIB, log=print) -> dict:
    """Make the bundle in `out` (see the module's docstring); its manifest."""
    comfyui = comfyui.resolve()
    if not (comfyui / "comfy").is_dir() or not (comfyui / "main.py").is_file():
        raise BundleError(f"--comfyui {comfyui}: not a ComfyUI tree (no comfy/ or main.py)")
    out.mkdir(parents=True, exist_ok=True)
    files, dropped = tree_files(comfyui)
    archive = out / ARCHIVE
    write_archive(comfyui, files, archive)
    tree_bytes = sum((comfyui / f).stat().st_size for f in files)
    log(f"tree: {len(files)} files, {tree_bytes / 2**20:.1f} MiB, {archive.stat().st_size / 2**20:.1f} MiB packed")
    have = target_packages(target)
    versions = installed_versions(versions_from)
    wanted, skipped = wanted_from_requirements(comfyui, have, versions)
    fetched = fetch_wheels(wanted, out / "wheels", have, versions) if wheels and wanted else []
    for w in fetched:
        log(f"wheel: {w.file} ({w.bytes / 2**20:.1f} MiB) for {w.serves}")
    parts = {ARCHIVE: archive.stat().st_size, "the repository's own files": repository_bytes()}
    parts.update({f"wheels/{w.file}": w.bytes for w in fetched})
    manifest = {
        "comfyui": {"version": comfyui_version(comfyui), "archive": ARCHIVE, "archive_bytes": parts[ARCHIVE],
                    "bytes": tree_bytes, "files": [[f.as_posix(), (comfyui / f).stat().st_size] for f in files],
                    "dropped": dropped},
        "python": PYTHON_VERSION, "platforms": list(PLATFORMS),
        "wheels": [asdict(w) for w in fetched],
        "wheels_not_fetched": [] if wheels else [w.spec for w in wanted],
        "requirements_not_fetched": skipped, "pure_wheels": {k: v for k, v in PURE_WHEELS.items()
                                                             if any(w.name == k for w in fetched)},
        "repository_bytes": parts["the repository's own files"],
        "total_bytes": sum(parts.values()), "limit_bytes": int(limit_mib * 2**20),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    check_size(parts, manifest["limit_bytes"])
    log(f"bundle + repository: {manifest['total_bytes'] / 2**20:.1f} MiB of {limit_mib:g} MiB")
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", type=Path, required=True, help="a ComfyUI tree (0.33.0 measured)")
    parser.add_argument("--out", type=Path, required=True, help="the bundle's folder (one git ignores: .comfy-bundle/)")
    parser.add_argument("--versions-from", metavar="PYTHON", help="fetch each package at the version this Python has "
                        "(the venv ComfyUI runs with here), where the requirement pins none")
    parser.add_argument("--target-packages", type=Path, default=TARGET_PACKAGES,
                        help="the packages the CUDA machine has, one a line")
    parser.add_argument("--limit-mib", type=float, default=MAX_BUNDLE_MIB)
    parser.add_argument("--no-wheels", action="store_true", help="the tree only (the wheels it would fetch are listed)")
    args = parser.parse_args(argv)
    try:
        assemble(args.comfyui, args.out, wheels=not args.no_wheels, versions_from=args.versions_from,
                 target=args.target_packages, limit_mib=args.limit_mib)
    except BundleError as error:
        print(f"comfy_bundle: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
