"""A job's working directory as Ray will walk it when packing: what would never finish packing is refused.

Ray's packing walk (``ray._private.runtime_env.packaging._dir_travel``) follows directory symlinks, so a link
back to a directory that contains it (``ln -s . current``, ``sub/up -> ..``) makes it pack the directory
inside itself until the kernel's link limit (or, with two such links, practically forever). And it zips
every file it reaches by reading it, so a named pipe (or a link to one) blocks the launch forever without a
word, and a socket or device file fails it. ``check_working_dir`` walks the directory first as Ray will --
the same excludes, ``.gitignore`` and ``.rayignore`` through Ray's own helpers, no file contents read,
stopping at the first problem -- and refuses such a link or file in one ``ConfigError`` sentence naming it.
``launch.ray.runtime_env`` calls it before shipping.
"""

from __future__ import annotations

import inspect
import logging
import os
import stat
from pathlib import Path
from typing import Optional, Sequence

from hybrid.errors import ConfigError


def check_working_dir(directory, excludes: Sequence[str] = (), include_gitignore: bool = True) -> None:
    """Refuse (``ConfigError``) a working directory that Ray would never finish packing: one where a directory
    link, reached by the walk Ray makes (it follows directory symlinks; ``excludes`` -- gitignore-style,
    anchored at ``directory`` -- and, per directory, ``.gitignore`` when ``include_gitignore`` and
    ``.rayignore`` leave paths out before it looks inside them), leads back to a directory that contains it,
    or where that walk reaches a file that is not a regular one (a named pipe, a socket, a device).
    A link whose contents all are excluded (``current/`` in ``.gitignore``) is no loop there and passes.
    Reads directory listings and file types only, never file contents (bar the ignore files), and stops at
    the first problem; a directory that is not there or cannot be read is left to Ray's own error."""
    try:
        found = _first_problem(Path(directory), list(excludes), include_gitignore)
    except RecursionError:  # a link-free tree deeper than Python's stack: Ray's walk says so itself
        return
    if found is None:
        return
    kind, path, where = found
    if kind == _LOOP:
        raise ConfigError(f"job.working_dir {directory} cannot be shipped to the ranks: its directory link {path} "
                          f"({where}) leads back to a directory that contains it, so Ray would pack the "
                          f"directory inside itself again and again; remove the link, add {path} to .gitignore, "
                          "or point job.working_dir at the code's directory.")
    raise ConfigError(f"job.working_dir {directory} cannot be shipped to the ranks: {path} is {where}, which Ray "
                      f"cannot pack (it reads every file it ships; a pipe would block the launch forever); "
                      f"remove it, add {path} to .gitignore, or point job.working_dir at the code's directory.")


_LOOP, _SPECIAL = "loop", "special file"


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


def _first_problem(directory: Path, excludes: list, include_gitignore: bool) -> Optional[tuple[str, str, str]]:
    """The first thing Ray's packing walk of ``directory`` would never finish with, as ``(kind, its path
    relative to directory, words)``: ``_LOOP``, a directory link through which the walk comes back to a
    directory it is already inside (``_describe_link``'s words), or ``_SPECIAL``, a file it reaches that is not
    a regular file (``_special_kind``'s words); None when there is none.

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

    def walk(path: Path, real: str, is_link: bool) -> Optional[tuple[str, str, str]]:
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
                return _LOOP, shown, _describe_link(link, shown, walking[0][1])
            walking.append((path, real, is_link))
            try:
                for entry in entries:
                    if not _entry_is_dir(entry):  # a file, or a link to nothing a walk enters
                        special = _special_kind(entry)
                        if special is not None and not excluded(Path(entry.path)):
                            return _SPECIAL, Path(entry.path).relative_to(root).as_posix(), special
                        continue
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


def _special_kind(entry: os.DirEntry) -> Optional[str]:
    """What ``entry`` is (followed through a symlink, as the zip reads it) when not a regular file: ``a named
    pipe``, ``a socket``, ``a device file``; None for a regular file or one that cannot be looked at (a
    dangling link: Ray's own error names it)."""
    try:
        mode = entry.stat().st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    return None


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
