# String annotations on purpose: schema modules may use them, the loader must resolve them.
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from hybridflow.config import ConfigError, config_to_dict, dump_yaml, load_config

VALIDATED: list[str] = []


@dataclass
class OptimCfg:
    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup: int | None = None


@dataclass
class ActorCfg:
    optim: OptimCfg = field(default_factory=OptimCfg)
    batch_size: int = 16
    mini_batch_size: int = 4
    use_kl: bool = False
    strategy: Literal["fsdp", "megatron"] = "fsdp"

    def validate(self):
        VALIDATED.append("actor")
        if self.batch_size % self.mini_batch_size:
            raise ValueError(
                f"mini_batch_size ({self.mini_batch_size}) must divide batch_size ({self.batch_size})"
            )


@dataclass
class DataCfg:
    train_files: list[str]
    batch_size: int = 8
    max_len: Optional[int] = None
    extra: dict[str, int] = field(default_factory=dict)


@dataclass
class Cfg:
    data: DataCfg
    actor: ActorCfg = field(default_factory=ActorCfg)
    ref: Optional[ActorCfg] = None
    name: str = "run"
    tags: tuple[str, ...] = ()

    def validate(self):
        VALIDATED.append("root")
        if self.data.batch_size > 1024:  # explicit raise: pytest rewrites asserts in this module
            raise AssertionError("data.batch_size too large")


@pytest.fixture
def cfgdir(tmp_path):
    def write(name, text):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return str(path)

    write.root = tmp_path
    return write


MIN = "data: {train_files: [a.parquet]}\n"


def load_err(cfgdir, text, overrides=(), name="x.yaml"):
    path = cfgdir(name, text)
    with pytest.raises(ConfigError) as info:
        load_config(Cfg, path, overrides)
    msg = str(info.value)
    assert "\n" not in msg
    return msg, path


# -------------------------------------------------------------- good load
def test_defaults_chain_overlay_and_overrides(cfgdir):
    cfgdir("common/model.yaml", """
        actor: {optim: {lr: 1.0e-5, warmup: 10}, strategy: megatron}
        name: model-default
    """)
    cfgdir("common/base.yaml", """
        defaults: [model.yaml]
        data: {train_files: [base.parquet], batch_size: 32}
        actor: {batch_size: 32, mini_batch_size: 8}
    """)
    exp = cfgdir("exp.yaml", """
        defaults: common/base.yaml
        actor: {optim: {lr: 1e-5}}   # YAML 1.1 reads this as a string; float field converts
        name: exp
    """)
    overlay = cfgdir("overlay.yaml", "data: {max_len: 512, extra: {k: 1}}\nname: overlay\n")
    VALIDATED.clear()
    cfg = load_config(Cfg, [exp, overlay], [
        "actor.optim.lr=3e-4", "data.train_files=[a.parquet, b.parquet]", "actor.use_kl=true",
        "tags=[x, y]", "ref.batch_size=8", "actor.optim.betas=[0.8, 1]",
    ])
    assert cfg.actor.optim.lr == pytest.approx(3e-4) and isinstance(cfg.actor.optim.lr, float)
    assert cfg.actor.optim.warmup == 10  # from two defaults levels down
    assert cfg.actor.optim.betas == [0.8, 1.0]
    assert cfg.actor.strategy == "megatron" and cfg.actor.use_kl is True
    assert (cfg.actor.batch_size, cfg.actor.mini_batch_size) == (32, 8)
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert (cfg.data.batch_size, cfg.data.max_len, cfg.data.extra) == (32, 512, {"k": 1})
    assert cfg.name == "overlay" and cfg.tags == ("x", "y")
    assert cfg.ref == ActorCfg(batch_size=8)  # override created the null section
    assert VALIDATED == ["actor", "actor", "root"]  # post-order: ref, actor, then root


def test_dump_round_trip(cfgdir):
    cfg = load_config(Cfg, cfgdir("x.yaml", MIN), ["tags=[a]", "actor.optim.lr=2e-5"])
    out = cfgdir.root / "dump" / "resolved.yaml"
    dump_yaml(cfg, out)
    assert load_config(Cfg, str(out)) == cfg
    assert config_to_dict(cfg)["tags"] == ["a"] and config_to_dict(cfg)["ref"] is None


def test_empty_file_and_null_optional(cfgdir):
    empty = cfgdir("empty.yaml", "")
    cfg = load_config(Cfg, [empty, cfgdir("x.yaml", MIN + "ref: null\n")], ["data.max_len=null"])
    assert cfg.ref is None and cfg.data.max_len is None and cfg.actor == ActorCfg()


# -------------------------------------------------------------- bad inputs
def test_unknown_key_suggests(cfgdir):
    msg, path = load_err(cfgdir, MIN + "actor: {optim: {lrr: 0.1}}\n")
    assert msg == f"unknown key 'actor.optim.lrr' in {path}; did you mean 'actor.optim.lr'?"


def test_unknown_key_without_suggestion(cfgdir):
    msg, path = load_err(cfgdir, MIN + "actor: {zzzzzz: 1}\n")
    assert msg == f"unknown key 'actor.zzzzzz' in {path}"


def test_unknown_key_from_base_file_names_base(cfgdir):
    base = cfgdir("base.yaml", "actor: {batchsize: 3}\n")
    msg, _ = load_err(cfgdir, "defaults: [base.yaml]\n" + MIN)
    assert msg == f"unknown key 'actor.batchsize' in {base}; did you mean 'actor.batch_size'?"


def test_unknown_override(cfgdir):
    msg, _ = load_err(cfgdir, MIN, ["actor.optim.lrr=1e-4"])
    assert msg == ("unknown key 'actor.optim.lrr' in override 'actor.optim.lrr=1e-4'; "
                   "did you mean 'actor.optim.lr'?")
    msg, _ = load_err(cfgdir, MIN, ["actr.batch_size=2"])
    assert msg == "unknown key 'actr' in override 'actr.batch_size=2'; did you mean 'actor'?"


def test_wrong_scalar_types(cfgdir):
    msg, path = load_err(cfgdir, "data: {train_files: [a], batch_size: abc}\n")
    assert msg == f"key 'data.batch_size' expects int, got str 'abc' (in {path})"
    msg, _ = load_err(cfgdir, MIN + "actor: {use_kl: 1}\n")
    assert msg.startswith("key 'actor.use_kl' expects bool, got int 1")
    msg, _ = load_err(cfgdir, MIN, ["actor.optim.lr=fast"])
    assert msg == "key 'actor.optim.lr' expects float, got str 'fast' (in override 'actor.optim.lr=fast')"
    msg, _ = load_err(cfgdir, MIN, ["actor.batch_size=1.5"])
    assert msg.startswith("key 'actor.batch_size' expects int, got float 1.5")
    msg, _ = load_err(cfgdir, MIN, ["name=3"])
    assert msg.startswith("key 'name' expects str, got int 3")


def test_optional_and_pipe_none_check_inner_type(cfgdir):
    msg, _ = load_err(cfgdir, "data: {train_files: [a], max_len: long}\n")
    assert msg.startswith("key 'data.max_len' expects int, got str 'long'")
    msg, _ = load_err(cfgdir, MIN, ["actor.optim.warmup=soon"])
    assert msg.startswith("key 'actor.optim.warmup' expects int, got str 'soon'")


def test_literal_lists_allowed_values(cfgdir):
    msg, _ = load_err(cfgdir, MIN + "actor: {strategy: ddp}\n")
    assert msg.startswith("key 'actor.strategy' expects one of ['fsdp', 'megatron'], got str 'ddp'")


def test_container_elements(cfgdir):
    msg, _ = load_err(cfgdir, "data: {train_files: [a, 3]}\n")
    assert msg.startswith("key 'data.train_files[1]' expects str, got int 3")
    msg, _ = load_err(cfgdir, "data: {train_files: a.parquet}\n")
    assert msg.startswith("key 'data.train_files' expects list[str], got str 'a.parquet'")
    msg, _ = load_err(cfgdir, "data: {train_files: [a], extra: {k: x}}\n")
    assert msg.startswith("key 'data.extra.k' expects int, got str 'x'")
    msg, _ = load_err(cfgdir, MIN, ["tags=x"])
    assert msg.startswith("key 'tags' expects tuple[str, ...], got str 'x'")


def test_missing_required(cfgdir):
    msg, _ = load_err(cfgdir, "data: {batch_size: 4}\n")
    assert msg == "missing required key 'data.train_files'"
    msg, _ = load_err(cfgdir, "name: x\n")
    assert msg == "missing required key 'data'"


def test_section_given_scalar(cfgdir):
    msg, path = load_err(cfgdir, MIN + "actor: 3\n")
    assert msg == f"key 'actor' expects a mapping (section ActorCfg), got int 3 (in {path})"
    msg, _ = load_err(cfgdir, MIN + "actor: {optim: [1, 2]}\n")
    assert msg.startswith("key 'actor.optim' expects a mapping (section OptimCfg), got list")


def test_validate_errors_prefixed_with_section(cfgdir):
    msg, _ = load_err(cfgdir, MIN + "actor: {batch_size: 12, mini_batch_size: 8}\n")
    assert msg == "actor: mini_batch_size (8) must divide batch_size (12)"
    msg, _ = load_err(cfgdir, MIN, ["ref.mini_batch_size=5"])
    assert msg == "ref: mini_batch_size (5) must divide batch_size (16)"
    msg, _ = load_err(cfgdir, MIN, ["data.batch_size=4096"])  # root: AssertionError, no prefix
    assert msg == "data.batch_size too large"


def test_child_validated_before_root(cfgdir):
    msg, _ = load_err(cfgdir, MIN, ["data.batch_size=4096", "actor.mini_batch_size=5"])
    assert msg.startswith("actor: ")


def test_bad_override_syntax(cfgdir):
    msg, _ = load_err(cfgdir, MIN, ["actor.optim.lr"])
    assert msg == "bad override 'actor.optim.lr': expected key.sub=value"
    msg, _ = load_err(cfgdir, MIN, ["actor..lr=1"])
    assert msg.startswith("bad override 'actor..lr=1': empty key segment")
    msg, _ = load_err(cfgdir, MIN + "name: run\n", ["name.first=x"])
    assert msg == "bad override 'name.first=x': 'name' is not a section (it is str 'run')"
    msg, _ = load_err(cfgdir, MIN, ["name.first=x"])  # name only has a schema default
    assert msg == "key 'name' expects str, got dict {'first': 'x'} (in override 'name.first=x')"
    msg, _ = load_err(cfgdir, MIN, ["tags=[a"])
    assert msg.startswith("bad override 'tags=[a': value '[a' is not valid YAML")


def test_file_errors(cfgdir):
    missing = str(cfgdir.root / "nope.yaml")
    with pytest.raises(ConfigError, match=f"^config file not found: {missing}$"):
        load_config(Cfg, missing)
    msg, path = load_err(cfgdir, "defaults: [gone.yaml]\n" + MIN)
    assert msg == f"config file not found: {cfgdir.root / 'gone.yaml'} (listed in defaults of {path})"
    msg, path = load_err(cfgdir, "data: [1, 2\n")
    assert msg.startswith(f"invalid YAML in {path} line ")
    msg, path = load_err(cfgdir, "- 1\n- 2\n")
    assert msg == f"{path}: top level must be a mapping, got list"
    msg, path = load_err(cfgdir, "defaults: {a: 1}\n" + MIN)
    assert msg.startswith(f"{path}: 'defaults' must be a list of file paths")


def test_duplicate_yaml_key(cfgdir):
    msg, path = load_err(cfgdir, MIN + "actor:\n  batch_size: 8\n  batch_size: 16\n")
    assert msg == f"invalid YAML in {path} line 4: duplicate key 'batch_size'"
    anchors = cfgdir("a.yaml", MIN + "actor: &a {batch_size: 8}\nref:\n  <<: *a\n  batch_size: 16\n")
    assert load_config(Cfg, anchors).ref.batch_size == 16  # `<<` merge keys may be overridden


def test_defaults_cycle(cfgdir):
    cfgdir("a.yaml", "defaults: [b.yaml]\n")
    cfgdir("b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match=r"^defaults cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml$"):
        load_config(Cfg, str(cfgdir.root / "a.yaml"))


def test_schema_must_be_dataclass():
    with pytest.raises(TypeError, match="must be a dataclass type"):
        load_config(dict, [])


def test_non_utf8_file_names_file_byte_and_line(cfgdir):
    base = cfgdir.root / "base.yaml"
    base.write_bytes(MIN.encode() + b"name: r\xe9sum\xe9\n")  # Latin-1, as an old editor saves it
    top = cfgdir("top.yaml", "defaults: [base.yaml]\n")
    with pytest.raises(ConfigError) as info:
        load_config(Cfg, top)
    offset = len(MIN) + len("name: r")
    assert str(info.value) == f"{base} is not UTF-8 text: byte {offset} (line 2) is 0xe9; save the file as UTF-8"


def test_utf8_with_byte_order_mark_loads(cfgdir):
    path = cfgdir.root / "bom.yaml"
    path.write_bytes("\ufeff".encode() + MIN.encode() + "name: résumé\n".encode())
    assert load_config(Cfg, str(path)).name == "résumé"


def test_an_override_may_name_its_own_origin(cfgdir):
    from hybridflow.config.loader import Override

    path = cfgdir("x.yaml", MIN)
    with pytest.raises(ConfigError) as info:
        load_config(Cfg, path, [Override("data.batch_size=1.5", "verl override 'data.train_batch_size=1.5'")])
    assert str(info.value) == ("key 'data.batch_size' expects int, got float 1.5 "
                               "(in verl override 'data.train_batch_size=1.5')")


@pytest.mark.parametrize("how", ["defaults", "two files"])
def test_an_empty_section_overrides_nothing(cfgdir, how):
    """`actor:` with nothing under it, in a file over a base that sets the section, plus an override of that
    section: the base's values stay (they were wiped, and still labelled as the base's), and each value names
    the file or override that really set it."""
    base = cfgdir("base.yaml", MIN + "actor: {batch_size: 32, mini_batch_size: 8, optim: {lr: 0.5}}\n")
    top = cfgdir("top.yaml", ("defaults: [base.yaml]\n" if how == "defaults" else "") + "actor:\nname: top\n")
    sources = {}
    cfg = load_config(Cfg, [top] if how == "defaults" else [base, top], ["actor.use_kl=true"], sources=sources)
    assert (cfg.actor.batch_size, cfg.actor.mini_batch_size, cfg.actor.optim.lr, cfg.actor.use_kl) == (32, 8, 0.5, True)
    assert (sources["actor.batch_size"], sources["actor.optim.lr"]) == (base, base)
    assert sources["actor.use_kl"] == "override 'actor.use_kl=true'" and sources["name"] == top


def test_an_empty_section_alone_means_its_defaults(cfgdir):
    cfg = load_config(Cfg, cfgdir("x.yaml", MIN + "actor:\n  optim:\n"), ["actor.batch_size=8"])
    assert cfg.actor == ActorCfg(batch_size=8)
