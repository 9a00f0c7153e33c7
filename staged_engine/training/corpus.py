"""The demo pair's corpus: Python source every machine that installs this project has.

Sources are the running Python's standard library and the installed distributions of this
project's requirements and everything they depend on (resolved from package metadata, so the
set is the same wherever ``requirements.txt`` is installed; versions are recorded). Files are
deduplicated by content (sha256) and split into train/val by that content hash, so a file
copied into two packages can never sit on both sides of the split.

A few whole packages are held out: their files never enter training, tokenizer or n-gram
statistics, and they measure generalisation to code written in a style the model has not seen
(bits per byte, comparable across tokenizers).
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import re
import sysconfig
from dataclasses import dataclass, field

# The project's requirements (requirements.txt), the roots of the dependency closure.
REQUIREMENTS = ("torch", "triton", "safetensors", "tokenizers", "transformers", "ninja", "pytest",
                "hypothesis", "setuptools", "wheel")
# Whole packages kept out of training: varied authors and styles, all in the closure above.
HELD_OUT = ("networkx", "rich", "click", "jinja2")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def norm_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def stdlib_root() -> str:
    """Directory of the running Python's standard library sources."""
    return sysconfig.get_path("stdlib")


@dataclass
class SourceFile:
    package: str  # "stdlib" or a normalised distribution name
    path: str  # absolute path
    rel: str  # "package/relative/path.py", stable across machines


@dataclass
class Package:
    name: str
    version: str
    files: list[SourceFile] = field(default_factory=list)


def stdlib_files(root: str | None = None) -> list[SourceFile]:
    """The ``.py`` files of the standard library, site-packages excluded, sorted."""
    root = root or stdlib_root()
    if not os.path.isdir(root):
        raise FileNotFoundError(f"corpus root not found: {root}")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                out.append(SourceFile("stdlib", full, "stdlib/" + rel))
    return out


def requirement_closure(roots=REQUIREMENTS) -> dict[str, md.Distribution]:
    """Installed distributions reachable from ``roots`` through unconditional requirements."""
    from packaging.requirements import Requirement

    seen: dict[str, md.Distribution] = {}
    stack = list(roots)
    while stack:
        name = norm_name(stack.pop())
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[name] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            stack.append(req.name)
    return dict(sorted(seen.items()))


def package_files(dist: md.Distribution) -> list[SourceFile]:
    name = norm_name(dist.metadata["Name"])
    out = []
    for f in dist.files or []:
        s = str(f)
        if not s.endswith(".py") or "__pycache__" in s or s.startswith(".."):
            continue
        full = str(f.locate())
        if os.path.isfile(full):
            out.append(SourceFile(name, full, f"{name}/{s}"))
    return sorted(out, key=lambda x: x.rel)


def packages(include_stdlib: bool = True, roots=REQUIREMENTS) -> list[Package]:
    """stdlib (if asked) and every distribution of the requirement closure, with their files."""
    import sys

    pkgs = []
    if include_stdlib:
        pkgs.append(Package("stdlib", sys.version.split()[0], stdlib_files()))
    for name, dist in requirement_closure(roots).items():
        files = package_files(dist)
        if files:
            pkgs.append(Package(name, dist.version, files))
    return pkgs


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split_of_hash(digest: str, val_fraction: float) -> str:
    """'val' or 'train' from a content sha256 (hex): the first 8 bytes as a fraction of 2**64."""
    return "val" if int(digest[:16], 16) / 2.0 ** 64 < val_fraction else "train"


@dataclass
class Corpus:
    train: list[tuple[str, str]]  # (rel, text)
    val: list[tuple[str, str]]
    held_out: list[tuple[str, str]]
    manifest: dict


def build(val_fraction: float = 0.02, held_out=HELD_OUT, roots=REQUIREMENTS,
          include_stdlib: bool = True, log=print) -> Corpus:
    """Read, deduplicate (by content) and split the corpus. Held-out packages are read too (for
    evaluation) and deduplicated against everything else: a held-out file whose exact content
    also appears in a training package is dropped from the held-out set."""
    held = {norm_name(h) for h in held_out}
    pkgs = packages(include_stdlib, roots)
    missing = held - {p.name for p in pkgs}
    if missing:
        raise ValueError(f"held-out packages not installed: {sorted(missing)}; install requirements.txt")
    train, val, held_docs = [], [], []
    seen: set[str] = set()
    manifest = {"val_fraction": val_fraction, "split": "sha256(content)[:8] / 2**64 < val_fraction -> val",
                "dedup": "exact file content (sha256); held-out files duplicated in training dropped",
                "held_out_packages": sorted(held), "packages": []}
    # Training packages first so that a duplicate shared with a held-out package stays in training.
    for p in sorted(pkgs, key=lambda p: (p.name in held, p.name)):
        rec = {"name": p.name, "version": p.version, "role": "held_out" if p.name in held else "train",
               "files": 0, "duplicates": 0, "non_utf8": 0, "empty": 0, "bytes": 0}
        for sf in p.files:
            with open(sf.path, "rb") as f:
                raw = f.read()
            if not raw.strip():
                rec["empty"] += 1
                continue
            digest = content_hash(raw)
            if digest in seen:
                rec["duplicates"] += 1
                continue
            seen.add(digest)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                rec["non_utf8"] += 1
                continue
            rec["files"] += 1
            rec["bytes"] += len(raw)
            if p.name in held:
                held_docs.append((sf.rel, text))
            elif split_of_hash(digest, val_fraction) == "val":
                val.append((sf.rel, text))
            else:
                train.append((sf.rel, text))
        manifest["packages"].append(rec)
    manifest["packages"].sort(key=lambda r: r["name"])
    for name, docs in (("train", train), ("val", val), ("held_out", held_docs)):
        manifest[f"files_{name}"] = len(docs)
        manifest[f"bytes_{name}"] = sum(len(t.encode("utf-8")) for _, t in docs)
    log(f"corpus: {len(pkgs)} packages; train {len(train)} files / {manifest['bytes_train'] / 1e6:.1f} MB, "
        f"val {len(val)} / {manifest['bytes_val'] / 1e6:.1f} MB, held out ({', '.join(sorted(held))}) "
        f"{len(held_docs)} / {manifest['bytes_held_out'] / 1e6:.1f} MB")
    return Corpus(train, val, held_docs, manifest)
