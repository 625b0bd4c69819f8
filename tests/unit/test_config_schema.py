"""config/schema.py states each key's type, valid values and default once (each tool its own keys, next to it, and
each strategy, data source and tokenizer its own, on its class or function: `config_keys`): each class mirrors one
conf file, so a key renamed or added in the file without its field (which the old string-keyed table skipped
silently), or a default changed in one place only, fails here."""

from __future__ import annotations

from dataclasses import MISSING, fields

import pytest
from omegaconf import OmegaConf

from parallama import CONF_DIR
from parallama.cli.ckpt import Convert
from parallama.cli.evaluate import Evaluate
from parallama.cli.generate import Generate
from parallama.cli.plan import Plan
from parallama.cli.prepare import Prepare
from parallama.config.parts import locate
from parallama.config.schema import SCHEMA, train_rules
from parallama.data.sources import HubKeys
from parallama.parallel.plan import declared_strategies
from parallama.rules import check_keys, rules

TOOLS = [Convert, Evaluate, Generate, Plan, Prepare]  # each tool's own keys, declared next to it
TRAIN = set(SCHEMA.values())
SHIPPED_STRATEGIES = declared_strategies([CONF_DIR])  # conf/strategy/<name>.yaml -> its class
STRATEGY_KEYS = {cls.config_keys for cls in SHIPPED_STRATEGIES.values() if cls.config_keys is not None}
SHIPPED_PARTS = {  # conf/data/source/<name>.yaml, conf/tokenizer/<name>.yaml -> the function it names
    str(p.relative_to(CONF_DIR).with_suffix("")): locate(OmegaConf.load(p)["_target_"])
    for group in ("data/source", "tokenizer")
    for p in sorted((CONF_DIR / group).glob("*.yaml"))
}
PART_KEYS = {keys for part in SHIPPED_PARTS.values() if (keys := getattr(part, "config_keys", None))}
CLASSES = sorted(TRAIN | STRATEGY_KEYS | PART_KEYS, key=lambda cls: cls.__name__) + TOOLS


def conf_node(conf: str, fields_of: type | None = None) -> dict:
    """The keys a conf file sets itself (`file.yaml:node.path` for a node in it), unresolved; without Hydra's
    `defaults`, `_target_`/`_partial_` and the nodes other classes mirror (a node that is a field of `fields_of`,
    such as a duration Hydra builds, is kept)."""
    file, _, node = conf.partition(":")
    data = OmegaConf.to_container(OmegaConf.load(CONF_DIR / file), resolve=False)
    for part in node.split(".") if node else []:
        data = data[part]
    kept = {f.name for f in fields(fields_of)} if fields_of else set()
    return {
        k: v
        for k, v in data.items()
        if k not in ("defaults", "_target_", "_partial_") and (not isinstance(v, dict) or k in kept)
    }


def defaults(cls) -> dict:
    return {
        f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        for f in fields(cls)
    }


@pytest.mark.parametrize("cls", CLASSES, ids=[cls.__name__ for cls in CLASSES])
def test_each_class_is_its_conf_file(cls):
    """The same keys, and each default the file's value."""
    file = conf_node(cls.conf, cls)
    assert defaults(cls) == file


def test_the_variants_of_a_group_use_their_class_s_keys():
    """fineweb is hub's keys at FineWeb's values; ddp_sharded and ddp_spawn take some of ddp's; every data source
    and the BPE tokenizer declare theirs (the byte tokenizer has none, a pretrained one its path only)."""
    assert SHIPPED_PARTS["data/source/fineweb"].config_keys is HubKeys
    assert conf_node("data/source/fineweb.yaml").keys() == defaults(HubKeys).keys()
    assert {keys.conf for keys in PART_KEYS} == {
        *(f"data/source/{name}.yaml" for name in ("embedded", "files", "hub")),
        "tokenizer/bpe.yaml",
    }
    ddp = SHIPPED_STRATEGIES["ddp"].config_keys
    for option in ("ddp_sharded", "ddp_spawn"):
        assert SHIPPED_STRATEGIES[option].config_keys is ddp  # inherited from DDP
        assert conf_node(f"strategy/{option}.yaml").keys() <= defaults(ddp).keys()
    mirrored = {keys.conf for keys in STRATEGY_KEYS}
    shipped = {f"strategy/{p.name}" for p in (CONF_DIR / "strategy").glob("*.yaml")}
    assert shipped - mirrored == {f"strategy/{name}.yaml" for name in ("auto", "ddp_sharded", "ddp_spawn")}
    assert "auto" not in SHIPPED_STRATEGIES  # a function (SingleDevice or DDP): its keys are the trainer's


def test_a_default_is_valid_by_its_own_rule():
    for cls in CLASSES:
        values = defaults(cls)
        for name, rule in rules(cls).items():
            value = values[name]
            if not (isinstance(value, str) and value.startswith(("${", "???"))):
                assert rule.valid(value), (cls.__name__, name, value)


def test_the_tools_read_their_rules_from_it():
    """parallama-prepare checks the training config's seed and data keys by the same rules, and the data
    source's and tokenizer's by the parts' own (`check_parts`)."""
    from hydra import compose, initialize_config_dir

    from parallama.cli.prepare import check
    from parallama.errors import ConfigError

    prepare = train_rules("seed", "data.")
    assert {"seed", "data.seq_len"} <= prepare.keys()
    assert train_rules("strategy.") == train_rules("data.source.") == {}  # their classes' (`config_keys`)
    for override, line in [
        ("data.seq_len=0", "data.seq_len=0 is not valid; use an integer >= 1"),
        ("data.source.corpus=poetry", "data.source.corpus='poetry' is not valid; use one of 'prose', 'code'"),
        ("tokenizer.vocab_size=100", "tokenizer.vocab_size=100 is not valid; use an integer >= 260"),
    ]:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("prepare", overrides=["tokenizer=bpe", override])
        with pytest.raises(ConfigError) as err:
            check(cfg)
        assert str(err.value) == line


def test_a_class_built_from_python_checks_its_arguments_by_the_same_rule():
    """The data module and the FSDP strategy check their arguments by their config's rules, not rules of their own."""
    from parallama.errors import ConfigError
    from parallama.parallel.strategies.fsdp import FSDP2

    with pytest.raises(
        ConfigError, match=r"^strategy.mixed_precision='int8' is not valid; use one of 'bf16', 'fp16'"
    ):
        FSDP2(mixed_precision="int8")


OPTIONS = [  # each shipped option of the groups the schema covers (and the presets), with its required values
    *[f"strategy={p.stem}" for p in sorted((CONF_DIR / "strategy").glob("*.yaml"))],
    *[f"trainer={p.stem}" for p in sorted((CONF_DIR / "trainer").glob("*.yaml"))],
    *[f"optimizer={p.stem}" for p in sorted((CONF_DIR / "optimizer").glob("*.yaml"))],
    *[f"logger={p.stem}" for p in sorted((CONF_DIR / "logger").glob("*.yaml"))],
    *[f"debug={p.stem}" for p in sorted((CONF_DIR / "debug").glob("*.yaml"))],
    *[f"experiment={p.stem}" for p in sorted((CONF_DIR / "experiment").glob("*.yaml"))],
    "callbacks=none",
    "tokenizer=bpe",
    "data/source=fineweb",
    "data/source=files data.source.paths=x.txt",
    "data/source=hub data.source.name=x",
]


@pytest.mark.parametrize("option", OPTIONS)
def test_every_shipped_option_is_valid_by_the_schema(option):
    from hydra import compose, initialize_config_dir

    from parallama.app.parts import check_parts
    from parallama.config.schema import check_schema
    from parallama.parallel.base import strategy_class

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=option.split())
    check_schema(cfg)
    check_parts(cfg)
    if (strategy := strategy_class(cfg.strategy)) is not None:
        check_keys(cfg, strategy.config_keys, "strategy")
