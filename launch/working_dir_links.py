"""A job's working directory as Ray will walk it when packing: a directory link that loops back is refused.

Ray's packing walk (``ray._private.runtime_env.packaging._dir_travel``) follows directory symlinks, so a link
back to a directory that contains it (``ln -s . current``, ``sub/up -> ..``) makes it pack the directory
inside itself until the kernel's link limit (or, with two such links, practically forever).
``check_working_dir_links`` walks the directory first as Ray will -- the same excludes, ``.gitignore`` and
``.rayignore`` through Ray's own helpers, no file contents read, stopping at the first loop -- and refuses
such a link in one ``ConfigError`` sentence naming it. ``launch.runtime_env`` calls it before shipping.
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

from hybrid.errors import ConfigError


def check_working_dir_links(directory, excludes: Sequence[str] = (), include_gitignore: bool = True) -> None:
    """Refuse (``ConfigError``) a working directory that Ray would never finish packing: one where a directory
    link, reached by the walk Ray makes (it follows directory symlinks; ``excludes`` -- gitignore-style,
    anchored at ``directory`` -- and, per directory, ``.gitignore`` when ``include_gitignore`` and
    ``.rayignore`` leave paths out before it looks inside them), leads back to a directory that contains it.
    A link whose contents all are excluded (``current/`` in ``.gitignore``) is no loop there and passes.
    Reads directory listings only, never file contents (bar the ignore files), and stops at the first loop;
    a directory that is not there or cannot be read is left to Ray's own error."""
    try:
        loop = _first_loop(Path(directory), list(excludes), include_gitignore)
    except RecursionError:  # a link-free tree deeper than Python's stack: Ray's walk says so itself
        return
    if loop is not None:
        link, where = loop
        raise ConfigError(f"job.working_dir {directory} cannot be shipped to the ranks: its directory link {link} "
                          f"({where}) leads back to a directory that contains it, so Ray would pack the "
                          f"directory inside itself again and again; remove the link, add {link} to .gitignore, "
                          "or point job.working_dir at the code's directory.")


# Ray's own messages while the check reads ignore files ("Ignoring upload to cluster for these files") stay
# out of the launcher's log: Ray says them again when it packs the directory.
_QUIET = logging.getLogger(__name__ + ".links")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


def ray_default_excludes() -> list[str]:
    """What Ray itself leaves out of every working directory (``RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES``)."""
    from ray._private import ray_constants

    defaults = getattr(ray_constants, "get_runtime_env_default_excludes", None)
    return list(defaults()) if defaults is not None else []


def _ignore_file_matchers(include_gitignore: bool):
    """``path -> [matcher]`` from the ignore files in directory ``path``, as Ray's walk reads them."""
    from ray._private.runtime_env import packaging

    helper = getattr(packaging, "get_excludes_from_ignore_files", None)
    if helper is not None:
        parameters = inspect.signature(helper).parameters
        options = {"include_gitignore": include_gitignore} if "include_gitignore" in parameters else {}
        if "logger" in parameters:
            options["logger"] = _QUIET
        return lambda path: list(helper(path, **options))
    older = getattr(packaging, "_get_gitignore", None)  # Ray before .rayignore: .gitignore only
    if older is not None and include_gitignore:
        return lambda path: [m for m in [older(path)] if m is not None]
    return lambda path: []


def _first_loop(directory: Path, excludes: list, include_gitignore: bool) -> Optional[tuple[str, str]]:
    """The first directory link (its path relative to ``directory``, and ``_describe_link``'s words) through
    which Ray's packing walk of ``directory`` would come back to a directory it is already inside, or None.

    Mirrors ``ray._private.runtime_env.packaging._dir_travel``: at each path, the ignore files there join the
    inherited matchers, a matched path is skipped whole, a directory (a symlink to one included) is entered.
    Every directory being walked is known by its real path (its parent's plus its name, resolved only at a
    symlink); a directory entered whose real path is, or contains, one of those comes back round -- unless all
    it holds is excluded there, as for a link ignored by a directory-only pattern such as ``current/``."""
    from ray._private.runtime_env.packaging import _get_excludes

    root = directory.absolute()
    if not _is_dir(root):
        return None
    ignore_files = _ignore_file_matchers(include_gitignore)
    matchers = [_get_excludes(root, excludes)]
    walking: list[tuple[Path, str, bool]] = []  # (path, real path, is a symlink) of the directories entered

    def excluded(path: Path) -> bool:  # a path inside the current directory, with its own ignore files
        own = ignore_files(path) if _is_dir(path) else []
        return any(match(path) for match in matchers + own)

    def walk(path: Path, real: str, is_link: bool) -> Optional[tuple[str, str]]:
        own = ignore_files(path)
        matchers.extend(own)
        try:
            if any(match(path) for match in matchers):
                return None
            entries = _listing(path)
            if entries is None:  # unreadable: Ray's own walk will say so
                return None
            inside = real.rstrip(os.sep) + os.sep
            back = [i for i, (_, seen, _) in enumerate(walking) if seen == real or seen.startswith(inside)]
            if back:
                if all(excluded(Path(entry.path)) for entry in entries):
                    return None  # nothing in it is packed: the walk ends here
                chain = walking[back[0] + 1:] + [(path, real, is_link)]
                link = next((p for p, _, symlink in reversed(chain) if symlink), path)
                shown = link.relative_to(root).as_posix()
                return shown, _describe_link(link, shown, walking[0][1])
            walking.append((path, real, is_link))
            try:
                for entry in entries:
                    if not _entry_is_dir(entry):
                        continue  # a file, or a link to nothing a walk enters
                    symlink = entry.is_symlink()
                    found = walk(Path(entry.path), os.path.realpath(entry.path) if symlink
                                 else os.path.join(real, entry.name), symlink)
                    if found is not None:
                        return found
            finally:
                walking.pop()
            return None
        finally:
            del matchers[len(matchers) - len(own):]

    return walk(root, os.path.realpath(root), False)


def _listing(path: Path) -> Optional[list]:
    try:
        with os.scandir(path) as entries:
            return sorted(entries, key=lambda entry: entry.name)
    except OSError:
        return None


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def _entry_is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows a symlink, as Path.is_dir in Ray's walk does
    except OSError:
        return False


def _describe_link(path: Path, shown: str, real_root: str) -> str:
    """``-> TARGET`` of the link at ``path`` (``shown``: its path relative to the working directory), after
    the link file's own place (relative to the working directory when inside it) when the walk reached it
    through another link."""
    try:
        target = os.readlink(path)
    except OSError:  # not a symlink itself: a directory reached through one
        return f"-> {os.path.realpath(path)}"
    home = os.path.join(os.path.realpath(path.parent), path.name)
    relative = os.path.relpath(home, real_root)
    if relative != os.pardir and not relative.startswith(os.pardir + os.sep):
        home = Path(relative).as_posix()
    return f"-> {target}" if home == shown else f"that is {home} -> {target}"
