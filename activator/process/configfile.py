"""Reading the config file: the shell around ``activator.core.config``.

This module decides how a file becomes the plain data that ``parse_config`` validates:

- the file is UTF-8 (a BOM is allowed) and holds exactly one YAML document, parsed
  with ``yaml.CSafeLoader`` (libyaml; YAML 1.1 scalars, no Python object tags);
- it composes the node tree rather than loading objects, so that every key keeps its
  line for error messages, and so that a key given twice in one mapping is an error
  (PyYAML's loaders silently keep the last one; here a duplicated pod list or limit
  must not pass unnoticed);
- anchors, aliases and merge keys (``<<: *defaults``) work as in PyYAML; explicit keys
  override merged ones, a recursive alias is an error;
- every failure (unreadable file, YAML syntax, an unknown tag, a bad value) is a
  ``ConfigError`` carrying the file name as the user gave it and, when known, the line;
- ``activators.secret_file`` is read here (the core sees the secret itself).
"""

from __future__ import annotations

import dataclasses
from typing import cast

import yaml

from ..core.config import MIN_SECRET_LENGTH, Config, KeyPath, parse_config, render_key_path
from ..core.errors import ConfigError

_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"
# A valid config is at most five levels deep; this bound keeps the recursive walk far
# from Python's recursion limit whatever the file holds.
_MAX_DEPTH = 64


def load_config(path: str) -> Config:
    """Read, parse and validate the config file at ``path``. Raises ConfigError."""
    try:
        with open(path, "rb") as file:
            raw = file.read()
    except OSError as exc:
        raise ConfigError(f"cannot read the file: {exc.strerror or exc}", filename=path) from exc
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError("the file is not valid UTF-8", filename=path, line=line) from exc
    return read_secret_file(parse_config_text(text, path))


def read_secret_file(config: Config) -> Config:
    """The config with ``activators.secret`` read from ``secret_file`` (stripped of
    surrounding whitespace). Raises ConfigError naming the key."""
    peers = config.activators
    if peers is None or peers.secret_file is None:
        return config
    key = "activators.secret_file"
    try:
        with open(peers.secret_file, "rb") as file:
            secret = file.read().decode("utf-8").strip()
    except OSError as exc:
        raise ConfigError(
            f"cannot read {peers.secret_file}: {exc.strerror or exc}", filename=config.path, key=key
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{peers.secret_file} is not UTF-8 text", filename=config.path, key=key) from exc
    if len(secret) < MIN_SECRET_LENGTH:
        raise ConfigError(
            f"{peers.secret_file} must hold a secret of at least {MIN_SECRET_LENGTH} characters",
            filename=config.path,
            key=key,
        )
    return dataclasses.replace(config, activators=dataclasses.replace(peers, secret=secret))


def parse_config_text(text: str, filename: str) -> Config:
    """Parse and validate config text; ``filename`` is only used in messages."""
    document = _Document(filename)
    root = document.compose(text)
    data = None if root is None else document.build(root, (), 0)
    return parse_config(data, filename=filename, line_of=document.line_of)


class _Document:
    """One YAML document as a node tree, and the plain data built from it."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.root: yaml.Node | None = None
        # CSafeLoader's own constructor, used for scalars only: collections are built
        # here, to check keys and keep their lines.
        self.constructor = yaml.constructor.SafeConstructor()
        self.built: dict[int, object] = {}  # id(node) -> data, so aliases are built once
        self.building: set[int] = set()  # ids of the nodes being built: a cycle guard

    def error(self, node: yaml.Node | None, path: KeyPath, message: str) -> ConfigError:
        line = None if node is None else node.start_mark.line + 1
        return ConfigError(message, filename=self.filename, line=line, key=render_key_path(path))

    def compose(self, text: str) -> yaml.Node | None:
        try:
            loader = yaml.CSafeLoader(text)
        except UnicodeEncodeError as exc:  # lone surrogates in a str that came from code
            line = text.count("\n", 0, exc.start) + 1
            raise ConfigError("the text is not valid Unicode", filename=self.filename, line=line) from exc
        try:
            self.root = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            raise self.syntax_error(exc) from exc
        except yaml.reader.ReaderError as exc:
            # libyaml reports the offset in the UTF-8 encoding of the text.
            line = text.encode("utf-8")[: exc.position].count(b"\n") + 1
            message = f"invalid YAML: {exc.reason} (character #x{exc.character:04x})"
            raise ConfigError(message, filename=self.filename, line=line) from exc
        finally:
            loader.dispose()
        return self.root

    def syntax_error(self, exc: yaml.MarkedYAMLError) -> ConfigError:
        """The line of the problem; the context (where the construct began) as words."""
        problem_mark, context_mark = exc.problem_mark, exc.context_mark
        mark = problem_mark or context_mark
        message = f"invalid YAML: {exc.problem or exc.context}"
        if exc.problem and exc.context:
            message += f"; {exc.context}"
            if context_mark and problem_mark and context_mark.line != problem_mark.line:
                message += f" on line {context_mark.line + 1}"
        line = None if mark is None else mark.line + 1
        return ConfigError(message, filename=self.filename, line=line)

    def build(self, node: yaml.Node, path: KeyPath, depth: int) -> object:
        """The plain data of ``node``; ``path`` and ``depth`` are where it was reached."""
        if id(node) in self.built:
            return self.built[id(node)]
        if id(node) in self.building:
            raise self.error(node, path, "an alias refers to a node that contains it")
        if depth > _MAX_DEPTH:
            raise self.error(node, path, f"nested more than {_MAX_DEPTH} levels deep")
        self.building.add(id(node))
        if isinstance(node, yaml.MappingNode):
            data: object = self.mapping(node, path, depth)
        elif isinstance(node, yaml.SequenceNode):
            if node.tag != _SEQ_TAG:
                raise self.error(node, path, f"unsupported tag {node.tag} on a list")
            data = [self.build(item, (*path, i), depth + 1) for i, item in enumerate(node.value)]
        else:
            data = self.scalar(node, path)
        self.building.discard(id(node))
        self.built[id(node)] = data
        return data

    def scalar(self, node: yaml.Node, path: KeyPath) -> object:
        try:
            return self.constructor.construct_object(node)
        # PyYAML's scalar constructors fail on explicitly tagged values in many ways
        # (``!!int abc`` ValueError, ``!!int ''`` IndexError, ``!!bool maybe`` KeyError,
        # ``!!timestamp x`` AttributeError, ...). Building one scalar is a pure function of
        # its text, so any failure means exactly "this value cannot be read".
        except Exception as exc:
            detail = getattr(exc, "problem", None) or str(exc)
            raise self.error(node, path, f"cannot read the value {node.value!r} ({node.tag}): {detail}") from exc

    def key(self, node: yaml.Node, path: KeyPath) -> object:
        if not isinstance(node, yaml.ScalarNode):
            raise self.error(node, path, "a key must be a plain value, not a list or a mapping")
        return self.scalar(node, path)

    def mapping(self, node: yaml.MappingNode, path: KeyPath, depth: int) -> dict[object, object]:
        if node.tag != _MAP_TAG:
            raise self.error(node, path, f"unsupported tag {node.tag} on a mapping")
        data: dict[object, object] = {}
        first_line: dict[object, int] = {}
        merged: dict[object, object] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                for source in self.merge_sources(value_node, path):
                    source_data = cast(dict[object, object], self.build(source, path, depth + 1))
                    for key, value in source_data.items():
                        merged.setdefault(key, value)
                continue
            key = self.key(key_node, path)
            key_path = (*path, key) if isinstance(key, str) else path
            if key in first_line:
                raise self.error(key_node, key_path, f"duplicate key (first given on line {first_line[key]})")
            first_line[key] = key_node.start_mark.line + 1
            data[key] = self.build(value_node, key_path, depth + 1)
        for key, value in merged.items():
            data.setdefault(key, value)
        return data

    def merge_sources(self, node: yaml.Node, path: KeyPath) -> list[yaml.MappingNode]:
        """The mappings a ``<<`` key merges, first one winning, as PyYAML does."""
        sources = _merged_nodes(node)
        mappings = [source for source in sources if isinstance(source, yaml.MappingNode)]
        if len(mappings) != len(sources):
            raise self.error(node, path, "<< (merge) needs a mapping or a list of mappings")
        return mappings

    def line_of(self, path: KeyPath) -> int | None:
        """The line of the key (or list item) at ``path``, else of its nearest ancestor."""
        node = self.root
        if node is None:
            return None
        line = int(node.start_mark.line) + 1
        for part in path:
            found = self.child(node, part)
            if found is None:
                break
            marker, node = found
            line = int(marker.start_mark.line) + 1
        return line

    def child(self, node: yaml.Node, part: str | int) -> tuple[yaml.Node, yaml.Node] | None:
        """(the node whose line names ``part``, the node of its value) in ``node``."""
        if isinstance(node, yaml.SequenceNode):
            if isinstance(part, int) and 0 <= part < len(node.value):
                item: yaml.Node = node.value[part]
                return item, item
            return None
        if not isinstance(node, yaml.MappingNode):
            return None
        for key_node, value_node in node.value:
            is_key = key_node.tag != _MERGE_TAG and isinstance(key_node, yaml.ScalarNode)
            # Every key was built before any line is looked up: this hits the cache.
            if is_key and self.constructor.construct_object(key_node) == part:
                return key_node, value_node
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                for source in _merged_nodes(value_node):
                    found = self.child(source, part)
                    if found is not None:
                        return found
        return None


def _merged_nodes(node: yaml.Node) -> list[yaml.Node]:
    """The nodes named by the value of a ``<<`` key: one mapping, or a list of them."""
    return list(node.value) if isinstance(node, yaml.SequenceNode) else [node]
