"""The scan of the data folder, started at launch in a process of its own while ``train.py`` imports.

A run's imports (torch, Lightning and what they load) take seconds before its first line, and a first run's
scan of ImageNet's 1.33 million files takes seconds more after them. ``start`` reads ``--data.root``,
``--data.index`` and ``--data.index_dir`` from the command line and its ``--config`` files, without the
command line's parser, and starts ``python -m lit_imagenet.data.prescan ROOT INDEX_DIR``: it scans the
splits into their index files (``lit_imagenet.data.index.cached_scan``) as the data module would. When the
data module comes to its scan it takes the index's lock, so it waits for the scan under way and reads
what it wrote; a later run finds the index and the scanning process reads it and ends.

It follows ``--config`` (or ``-c``) files and YAML text, and ``--data`` given a file or a mapping, in their
order; a config given before the subcommand (``train.py --config all.yaml fit``) gives its section of that
subcommand. The early scan only saves time; it decides nothing. Whatever it finds wrong (a missing folder, an
empty class folder, a file that is not an image) it leaves no index for, and the data module's own scan stops the
run with that error. Where the command line sets the data options in a form this reading does not follow
(``--data.init_args.root``, say), or names another root than the parser finds, the data module scans as it
would without it. Only the first process of a node starts it (``LOCAL_RANK`` and
``SLURM_LOCALID`` unset or 0): the others are started after the imports of the first, by Lightning or the
cluster's launcher, and read the index.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The subcommands whose data module scans ``--data.root``.
SCANNING = ("fit", "validate", "test", "predict")
#: Flags after which the command does not run.
NOT_RUNNING = ("-h", "--help", "--print_config")


def option_at(words: list[str], k: int) -> tuple[str, str | None, int]:
    """The option at ``words[k]``: its name, its value (given after ``=``, joined to ``-c``, or the next word;
    ``None`` at the end) and how many words it takes, as the command line's parser reads it. ``cli.py`` reads the
    command line's configs with it too."""
    word = words[k]
    if word.startswith("-c") and len(word) > 2 and not word.startswith("--"):
        return "-c", word[2:].removeprefix("="), 1  # -cFILE, -c=FILE
    key, eq, value = word.partition("=")
    if eq:
        return key, value, 1
    return key, words[k + 1] if k + 1 < len(words) else None, 2


def section_options(argv: list[str], section: str, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """The options ``keys`` of ``section`` (``data``, ``trainer``) that ``argv`` sets: the subcommand's section of the
    ``--config`` files given before it, then its own ``--config`` files and flags, each overriding what came before;
    ``None`` where it is not a scanning subcommand. A key given option by option (``--trainer.strategy.start_method
    spawn``) reads as a mapping of those options."""
    if any(word.partition("=")[0] in NOT_RUNNING for word in argv):
        return None
    options: dict[str, Any] = {}
    before: list[str] = []  # the configs given before the subcommand: {fit: {data: ...}, validate: ...}
    k = 0
    while k < len(argv) and argv[k] not in SCANNING:
        key, value, step = option_at(argv, k)
        if key not in ("--config", "-c") or value is None:
            return None  # another subcommand, or an option the parser will refuse
        before.append(value)
        k += step
    if k == len(argv):
        return None
    command = argv[k]
    for value in before:
        found = (yaml_mapping(value) or {}).get(command)
        options.update(_section_keys(found.get(section) if isinstance(found, dict) else None, keys))
    words = argv[k + 1 :]
    k = 0
    while k < len(words):
        key, value, step = option_at(words, k)
        name, _, deeper = key.removeprefix(f"--{section}.").partition(".")
        if value is None:
            step = 1
        elif key in ("--config", "-c"):
            options.update(_section_keys((yaml_mapping(value) or {}).get(section), keys))
        elif key == f"--{section}":
            options.update(_section_keys(yaml_mapping(value), keys))
        elif key.startswith(f"--{section}.") and name in keys:
            if deeper:
                given = options.get(name)
                options[name] = {**(given if isinstance(given, dict) else {}), deeper: value}
            else:
                options[name] = value
        else:
            step = 1
        k += step
    return options


def _options(argv: list[str]) -> dict[str, Any] | None:
    """The ``data`` options that ``argv`` sets (``root``, ``index``, ``index_dir``); ``None`` where it is not a
    scanning subcommand."""
    return section_options(argv, "data", ("root", "index", "index_dir"))


def yaml_mapping(value: str) -> dict[str, Any] | None:
    """A config argument's mapping: the file's, or the YAML text's itself; ``None`` if neither is one (the
    command line's parser then says why)."""
    import yaml

    try:
        text = Path(value).read_text() if Path(value).is_file() else value
        loaded = yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return loaded if isinstance(loaded, dict) else None


def _section_keys(mapping: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """``keys`` of a section's mapping, given plainly or under ``init_args``."""
    if not isinstance(mapping, dict):
        return {}
    mapping = mapping["init_args"] if isinstance(mapping.get("init_args"), dict) else mapping
    return {key: mapping[key] for key in keys if key in mapping}


def _index_on(value: Any) -> bool:
    return str(value).strip().lower() not in ("false", "0", "no", "off")


def target(argv: list[str]) -> tuple[Path, Path] | None:
    """The data folder and index folder that the run of ``argv`` would scan into, or ``None`` where it would not
    (another subcommand, no index, no root given, no ``train`` folder under it)."""
    options = _options(argv)
    if not options or "root" not in options or not _index_on(options.get("index", True)):
        return None
    root = Path(str(options["root"]))
    if not (root / "train").is_dir():
        return None
    index_dir = options.get("index_dir")
    if index_dir in (None, "null", "None", ""):
        from lit_imagenet.data.index import default_index_dir

        return root, default_index_dir()
    return root, Path(str(index_dir))


def start(argv: list[str]) -> subprocess.Popen[bytes] | None:
    """Starts scanning the data folder of the run of ``argv`` into its index, in a process of its own; ``None``
    where there is nothing to scan or this is not the first process of its node. The process writes to this one's
    standard error: the warning that an index was damaged and written anew comes from it."""
    if os.environ.get("LOCAL_RANK", "0") != "0" or os.environ.get("SLURM_LOCALID", "0") != "0":
        return None
    found = target(argv)
    if found is None:
        return None
    root, index_dir = found
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "lit_imagenet.data.prescan", str(root), str(index_dir)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
    except OSError:
        return None


def stop(scan: subprocess.Popen[bytes] | None) -> None:
    """Ends the scan that ``start`` started if it still runs (the run ended before its data module read the
    index), and collects its exit."""
    if scan is None:
        return
    if scan.poll() is None:
        scan.terminate()  # an index file being written is removed (_scan)
        try:
            scan.wait(timeout=10)
        except subprocess.TimeoutExpired:
            scan.kill()
    scan.wait()


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _scan(root: Path, index_dir: Path) -> int:
    """Scans ``root``'s splits into ``index_dir``: 0 when the indexes were read or written, 1 where the folder
    is wrong (the data module's own scan names what), 130 on Ctrl-C; on SIGTERM it exits, removing a temporary
    index file it was writing."""
    signal.signal(signal.SIGTERM, _terminated)
    try:
        from lit_imagenet.data.folders import scan_root

        scan_root(root, index_dir)
    except KeyboardInterrupt:
        return 130
    except Exception:  # noqa: BLE001  (the data module's own scan stops the run with it)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_scan(Path(sys.argv[1]), Path(sys.argv[2])))
