"""Checks that every relative link in README.md and docs/**/*.md resolves inside the repository.

    python3 docs/check_links.py

A link's file (or directory) must exist and lie inside the repository; a `#fragment` must name
a heading of the target file, slugged as GitHub does. Links with a scheme (https:, mailto:) are
not followed. Prints each broken link and exits 1 if there is one.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_files():
    yield os.path.join(ROOT, "README.md")
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        for name in sorted(files):
            if name.endswith(".md"):
                yield os.path.join(folder, name)


def prose_lines(path):
    """The file's lines outside fenced code blocks, with their numbers."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if FENCE.match(line):
                fenced = not fenced
                continue
            if not fenced:
                yield number, line


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*?|_(?=\w)|(?<=\w)_", lambda m: "_" if m.group(0) == "_" else "", heading)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    seen, result = {}, set()
    for _, line in prose_lines(path):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            result.add(base if n == 0 else f"{base}-{n}")
    return result


def main():
    broken = 0
    for path in markdown_files():
        for number, line in prose_lines(path):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue
                file_part, _, fragment = target.partition("#")
                resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
                where = f"{os.path.relpath(path, ROOT)}:{number}: {target}"
                if not resolved.startswith(ROOT + os.sep) and resolved != ROOT:
                    print(f"{where}: outside the repository")
                    broken += 1
                elif not os.path.exists(resolved):
                    print(f"{where}: no such file")
                    broken += 1
                elif fragment and resolved.endswith(".md") and fragment not in anchors(resolved):
                    print(f"{where}: no heading #{fragment}")
                    broken += 1
    print(f"links: {'ok' if broken == 0 else f'{broken} broken'}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
