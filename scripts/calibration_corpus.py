"""Writes the multi-genre text of Spotlight's calibration (training genres) and of its held-out evaluation (genres no
shipped artifact is trained or tuned on), all from packages of the Debian archive and the embedded essays.

    apt-get download python3.11-doc libpython3.11-stdlib manpages r-cran-janeaustenr
    python scripts/calibration_corpus.py . OUT_DIR

Genres, sources, checksums and licences: docs/calibration-data.md.

Files are read in sorted path order, so the output is the same on every machine.
"""

from __future__ import annotations

import gzip
import re
import subprocess
import sys
import tempfile
from pathlib import Path

DEBS = {
    "docs": "python3.11-doc_3.11.2-6+deb12u8_all.deb",
    "code": "libpython3.11-stdlib_3.11.2-6+deb12u8_amd64.deb",
    "manpages": "manpages_6.03-2_all.deb",
    "literature": "r-cran-janeaustenr_1.0.0-1_all.deb",
}
HELDOUT_FRACTION = 0.2  # the last files of each training genre, kept for evaluation
#: troff macros whose arguments are text (font changes, headings, paragraph tags)
TEXT_MACROS = {"B", "I", "BR", "BI", "IB", "IR", "RB", "RI", "SB", "SM", "SH", "SS", "TP", "IP", "TQ", "UR", "MT"}
TROFF_ESCAPES = [
    (re.compile(r"\\f[BIRPC]|\\f\(..|\\f\[[^\]]*\]"), ""),
    (re.compile(r"\\\(em|\\\[em\]"), "\u2014"),
    (re.compile(r"\\\(en|\\\[en\]"), "\u2013"),
    (re.compile(r"\\\((aq|dq)"), "'"),
    (re.compile(r"\\[-e]"), lambda m: "-" if m.group(0) == "\\-" else "\\"),
    (re.compile(r"\\&|\\:|\\%|\\c"), ""),
    (re.compile(r"\\ "), " "),
]


def extract(deb: Path, into: Path) -> Path:
    subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)
    return into


def troff_text(source: str) -> str:
    """The readable text of a man page: comments and layout requests dropped, text macros' arguments kept."""
    lines = []
    for line in source.splitlines():
        if line.startswith((".\\\"", "'\\\"", '.\\"')):
            continue
        if line.startswith((".", "'")):
            macro, _, rest = line[1:].partition(" ")
            if macro not in TEXT_MACROS or not rest.strip():
                continue
            line = rest.replace('"', "")
        for pattern, replacement in TROFF_ESCAPES:
            line = pattern.sub(replacement, line)
        lines.append(line)
    return "\n".join(lines).strip()


def join(parts: list[str]) -> str:
    return "\n\n".join(p.strip() for p in parts if p.strip()) + "\n"


def write_split(out: Path, genre: str, files: list[str]) -> None:
    """<genre>.txt for training and <genre>-heldout.txt, its last files (20% of the characters), for evaluation."""
    from sparsekv.training.capture import split_essays

    train, held = split_essays([f for f in files if f.strip()], HELDOUT_FRACTION)
    (out / f"{genre}.txt").write_text(train + "\n", encoding="utf-8")
    (out / f"{genre}-heldout.txt").write_text(held + "\n", encoding="utf-8")


def main(deb_dir: str, out_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from heldout_literature_text import main as literature

    from sparsekv.training.capture import haystack_split

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    missing = [name for name in DEBS.values() if not (Path(deb_dir) / name).is_file()]
    if missing:
        sys.exit(f"missing in {deb_dir}: {', '.join(missing)} (apt-get download them)")
    essays, held_essays = haystack_split(HELDOUT_FRACTION)
    (out / "essays.txt").write_text(essays + "\n", encoding="utf-8")
    (out / "essays-heldout.txt").write_text(held_essays + "\n", encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        docs = extract(Path(deb_dir) / DEBS["docs"], tmp / "docs") / "usr/share/doc/python3.11/html/_sources"
        write_split(out, "docs", [p.read_text(encoding="utf-8") for p in sorted(docs.rglob("*.rst.txt"))])
        code = extract(Path(deb_dir) / DEBS["code"], tmp / "code") / "usr/lib/python3.11"
        sources = [p for p in sorted(code.rglob("*.py")) if p.is_file() and not p.is_symlink()]
        write_split(out, "code", [p.read_text(encoding="utf-8", errors="replace") for p in sources])
        man = extract(Path(deb_dir) / DEBS["manpages"], tmp / "man") / "usr/share/man"
        pages = [troff_text(gzip.decompress(p.read_bytes()).decode("utf-8", "replace"))
                 for p in sorted(man.rglob("*.gz"))]  # fmt: skip
        (out / "manpages.txt").write_text(join(pages), encoding="utf-8")
        lit = extract(Path(deb_dir) / DEBS["literature"], tmp / "lit") / "usr/lib/R/site-library/janeaustenr/data"
        literature(str(lit), str(out))
    for path in sorted(out.glob("*.txt")):
        print(f"{path.name}: {len(path.read_text(encoding='utf-8')):,} characters")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
