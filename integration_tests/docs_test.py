"""Checks that keep the documentation in step with the repository.

- Every relative link of `README.md` and `docs/*.md`, `[text](path)` or
  `[text](path#anchor)`, names a file or folder that exists, and its
  anchor a heading of that file (GitHub's slugs). Links in code blocks
  and code spans are not links; `http(s)://` and `mailto:` links are
  not fetched.
- Every `<!-- example: PATH -->` marker (PATH relative to the repository
  root) is followed on the next line by a ```python block whose content
  is the file at PATH, exactly (but for a trailing newline).
- Every example, each file under `examples/` and each file a marker
  names, runs under torchrun on 2 gloo processes within `TIMEOUT`
  seconds and exits with status 0. Examples that import keras_hub skip
  where keras-hub or grain is missing, except under CI, where they fail
  (`harness.require`).
"""

import glob
import os
import re

import harness
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 240
# Arguments that keep an example short.
EXAMPLE_ARGS = {
    "examples/transformer_2d.py": ["--steps", "2"],
}

FENCE = re.compile(r"^\s*(```|~~~)")
MARKER = re.compile(r"^<!--\s*example:\s*(\S+)\s*-->\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=[\"']([^\"']+)[\"']")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def doc_files():
    """README.md and docs/*.md, as paths relative to the root."""
    pages = sorted(
        os.path.relpath(path, ROOT)
        for path in glob.glob(os.path.join(ROOT, "docs", "*.md"))
    )
    return ["README.md", *pages]


def read(relative):
    with open(os.path.join(ROOT, relative), encoding="utf-8") as f:
        return f.read()


def prose_lines(text):
    """`(line number, line)` of each line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
                continue
            yield number, line
        elif match and match.group(1) == fence:
            fence = None


def prose_text(text):
    """The text outside fenced code blocks and code spans, with line
    numbers kept."""
    kept = {number: line for number, line in prose_lines(text)}
    lines = text.splitlines()
    prose = "\n".join(kept.get(n, "") for n in range(1, len(lines) + 1))
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)


def links(text):
    """`(line number, target)` of each Markdown link in the prose."""
    prose = prose_text(text)
    for match in LINK.finditer(prose):
        line = prose.count("\n", 0, match.start()) + 1
        yield line, match.group(2)


def slug(heading):
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text):
    """The anchors of a Markdown file: its headings' slugs (repeated ones
    numbered as GitHub numbers them) and its HTML anchors."""
    found = set()
    counts = {}
    for _, line in prose_lines(text):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = counts.get(base, 0)
        counts[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(relative):
    """Messages for the broken relative links of one Markdown file."""
    text = read(relative)
    folder = os.path.dirname(os.path.join(ROOT, relative))
    problems = []
    for line, target in links(text):
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(folder, path))
        where = f"{relative}:{line}: {target}"
        if path and not os.path.exists(resolved):
            problems.append(f"{where}: no such file")
            continue
        if not anchor:
            continue
        page = resolved if path else os.path.join(ROOT, relative)
        if not page.endswith(".md") or os.path.isdir(page):
            continue
        with open(page, encoding="utf-8") as f:
            if anchor not in anchors(f.read()):
                problems.append(f"{where}: no heading with that anchor")
    return problems


def example_markers(relative):
    """`(line number, example path, block or None)` for each marker of a
    Markdown file; the block is the ```python block on the next line."""
    lines = read(relative).splitlines()
    markers = []
    for number, line in prose_lines("\n".join(lines)):
        match = MARKER.match(line.strip())
        if not match:
            continue
        block = None
        following = lines[number:]
        if following and following[0].strip() == "```python":
            body = []
            for inner in following[1:]:
                if inner.strip() == "```":
                    block = "\n".join(body)
                    break
                body.append(inner)
        markers.append((number, match.group(1), block))
    return markers


def example_files():
    """Every file under examples/ and every file a marker names."""
    files = {
        os.path.relpath(path, ROOT)
        for path in glob.glob(os.path.join(ROOT, "examples", "*.py"))
    }
    for page in doc_files():
        files.update(path for _, path, _ in example_markers(page))
    return sorted(files)


@pytest.mark.parametrize("page", doc_files())
def test_relative_links_resolve(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", doc_files())
def test_example_blocks_equal_their_files(page):
    for line, path, block in example_markers(page):
        where = f"{page}:{line}: {path}"
        assert block is not None, f"{where}: no ```python block follows"
        full_path = os.path.join(ROOT, path)
        assert os.path.isfile(full_path), f"{where}: no such file"
        with open(full_path, encoding="utf-8") as f:
            content = f.read()
        assert block.rstrip("\n") == content.rstrip("\n"), (
            f"{where}: the block differs from the file"
        )


@pytest.mark.parametrize("example", example_files())
def test_example_runs_on_two_processes(example, tmp_path):
    path = os.path.join(ROOT, example)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    if re.search(r"^\s*(import|from)\s+keras_hub\b", source, re.M):
        harness.require("keras_hub")
        harness.require("grain")
    # From a folder of its own: an example may write files where it runs.
    harness.run_script(
        path, 2, EXAMPLE_ARGS.get(example, []), TIMEOUT, str(tmp_path)
    )


def test_link_check_finds_broken_links(tmp_path, monkeypatch):
    """The checks above fail where they should (on a page made here)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# Title: `one`, two!\n\n## Title: one, two\n\n"
        "[ok](a.md#title-one-two) [ok](#title-one-two-1) [ok](../README.md)\n"
        "[bad](b.md) [bad](#nothing) [web](https://example.com/x)\n"
        "`[code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n"
        "<!-- example: ex.py -->\n```python\nprint(1)\n```\n"
        "<!-- example: ex.py -->\n\n```python\nprint(1)\n```\n"
    )
    (tmp_path / "README.md").write_text("")
    (tmp_path / "ex.py").write_text("print(1)\n")
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    problems = broken_links(os.path.join("docs", "a.md"))
    assert [p.split(": ", 1)[1] for p in problems] == [
        "b.md: no such file",
        "#nothing: no heading with that anchor",
    ]
    markers = example_markers(os.path.join("docs", "a.md"))
    assert [(path, block) for _, path, block in markers] == [
        ("ex.py", "print(1)"),
        ("ex.py", None),
    ]
