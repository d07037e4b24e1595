"""zerofast.integrations.hosts: the check an integration runs at import on what it overrides, reads
and calls in its host framework. Made-up hosts for each way a host can change (a member gone, a
signature changed, a kind changed, a name taken, a call refused, an attribute its constructor no
longer sets) and for the versions (tested, untested in range, outside the range); then the real
tables against real hosts with a method renamed, and the tables kept in step with pyproject.toml's
extras and the Makefile's pins. In this process, no launch: about 5 s, most of it importing
transformers and Lightning."""

import contextlib
import os
import re
import types
import warnings

import pytest

from zerofast.integrations import hosts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIN = hosts.Pin("hostlib", tested="2.3.1", supported=">=2.3.1,<2.4")


class Host:
    limit = 3

    def save(self, model, trial):
        pass

    @property
    def skipped(self):
        return False

    def write(self, path, state_dict=None):
        pass


class Mixin:
    def save(self, model, trial):
        pass

    @property
    def skipped(self):
        return True

    def _ours(self):  # a member of our own, under a name the host does not use
        pass


def _reliance(host=Host, mixin=Mixin, names=("save", "skipped"), extra_entries=()):
    return hosts.Reliance(
        "zerofast.integrations.fake",
        extra="fake",
        pins=(PIN,),
        entries=(hosts.Overrides(mixin, host, names), *extra_entries),
    )


@contextlib.contextmanager
def _no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _error(reliance, version="2.3.1") -> str:
    with pytest.raises(hosts.IncompatibleHostError) as caught:
        hosts.check(reliance, versions={"hostlib": version})
    message = str(caught.value)
    # Every error names the versions written against and installed, and how to get a supported one.
    assert "written and tested against hostlib 2.3.1" in message and "hostlib>=2.3.1,<2.4" in message
    assert f"hostlib {version}" in message and 'pip install "zerofast[fake]"' in message
    return message


def test_the_tested_version_with_every_member_passes_silently():
    with _no_warning():
        hosts.check(_reliance(), versions={"hostlib": "2.3.1"})


def test_a_method_gone_from_the_host_is_named():
    class Renamed:
        def save_checkpoint(self, model, trial):
            pass

        skipped = Host.skipped

    message = _error(_reliance(host=Renamed), version="2.3.5")
    assert (
        f"{__name__}.test_a_method_gone_from_the_host_is_named.<locals>.Renamed.save: missing (Mixin overrides it)"
        in message
    )


def test_a_parameter_the_override_does_not_take_is_named():
    class Grown(Host):
        def save(self, model, trial, metrics=None):
            pass

    message = _error(_reliance(host=Grown))
    assert "Grown.save(self, model, trial, metrics=None): Mixin.save(self, model, trial) does not take" in message
    assert "metrics (by position)" in message and "metrics= (by keyword)" in message


def test_a_parameter_renamed_or_moved_is_named():
    class Moved(Host):
        def save(self, trial, model):
            pass

    assert "trial (at position 1, which is model here)" in _error(_reliance(host=Moved))


def test_an_argument_the_override_requires_and_the_host_does_not_is_named():
    class Defaulted(Host):
        def save(self, model, trial=None):
            pass

    assert "Mixin.save(self, model, trial) does not take a call without trial (required here)" in _error(
        _reliance(host=Defaulted)
    )


def test_an_override_that_takes_more_than_the_host_passes():
    class Flexible:
        def save(self, model, trial=None, *args, **kwargs):
            pass

        skipped = Mixin.skipped

    class Grown(Host):
        def save(self, model, trial, metrics=None, *, step=0, **more):
            pass

    with _no_warning():
        hosts.check(_reliance(host=Grown, mixin=Flexible), versions={"hostlib": "2.3.1"})


def test_a_method_become_a_property_is_named():
    class Changed(Host):
        @property
        def save(self):
            return None

    assert "Changed.save: a property there, a method in Mixin" in _error(_reliance(host=Changed))


def test_a_host_member_under_a_name_we_add_is_named():
    class Taken(Host):
        def _ours(self):
            pass

    assert "Taken._ours: now exists, and Mixin._ours would replace it" in _error(_reliance(host=Taken))


def test_a_call_the_host_no_longer_takes_is_named():
    class Narrowed(Host):
        def write(self, path):
            pass

    calls = hosts.Calls(Narrowed, "write", 1, ("state_dict",))
    message = _error(_reliance(extra_entries=(calls,)))
    assert "Narrowed.write(self, path): no longer takes the call (*, state_dict=)" in message
    with _no_warning():  # the original takes it
        hosts.check(_reliance(extra_entries=(hosts.Calls(Host, "write", 1, ("state_dict",)),)), {"hostlib": "2.3.1"})


def test_a_constant_gone_from_a_module_is_named():
    module = types.ModuleType("hostlib.trainer")
    module.SCHEDULER_NAME = "scheduler.pt"
    reads = hosts.Reads(module, ("SCHEDULER_NAME", "TRAINER_STATE_NAME"))
    assert "hostlib.trainer.TRAINER_STATE_NAME: missing" in _error(_reliance(extra_entries=(reads,)))


def test_every_problem_is_named_at_once():
    class Broken:
        limit = 3

    message = _error(_reliance(host=Broken, extra_entries=(hosts.Reads(Broken, ("limit", "gone")),)))
    assert message.count("\n  - ") == 3 and "Broken.save: missing" in message and "Broken.skipped: missing" in message


def test_an_untested_version_inside_the_range_warns():
    with pytest.warns(hosts.UntestedHostWarning) as seen:
        hosts.check(_reliance(), versions={"hostlib": "2.3.4"})
    message = str(seen[0].message)
    assert "runs on hostlib 2.3.4, which it was not tested with" in message
    assert "written and tested against hostlib 2.3.1; supported: hostlib>=2.3.1,<2.4" in message
    with pytest.warns(hosts.UntestedHostWarning, match=r"hostlib \(version unknown\)"):
        hosts.check(_reliance(), versions={"hostlib": None})


def test_a_version_outside_the_range_raises_unless_allowed(monkeypatch):
    for version in ("2.4.0", "2.2.9", "3.0.0rc1"):
        message = _error(_reliance(), version=version)
        assert "does not support hostlib" in message and hosts.ALLOW_UNTESTED in message
    monkeypatch.setenv(hosts.ALLOW_UNTESTED, "1")
    with pytest.warns(hosts.UntestedHostWarning, match="runs on hostlib 2.4.0"):
        hosts.check(_reliance(), versions={"hostlib": "2.4.0"})

    class Broken:
        pass

    _error(_reliance(host=Broken), version="2.4.0")  # a member gone still raises


def test_an_attribute_the_constructor_no_longer_sets_is_named():
    class Built:
        def __init__(self):
            self.accelerator = object()

    reliance = _reliance(extra_entries=(hosts.Reads(Built, ("accelerator", "_layer_sync"), on_instance=True),))
    with _no_warning():
        hosts.check(reliance, versions={"hostlib": "2.3.1"})  # not on the class: left to check_instance
    with pytest.raises(
        hosts.IncompatibleHostError, match=r"Built._layer_sync: missing \(an attribute its constructor set\)"
    ):
        hosts.check_instance(reliance, Built())
    hosts.check_instance(reliance, object())  # not an instance of that host: nothing to check


def test_a_table_that_names_a_member_we_do_not_define_is_a_bug():
    with pytest.raises(TypeError, match="Mixin does not define 'load'"):
        hosts.check(_reliance(names=("save", "load")), versions={"hostlib": "2.3.1"})


# --- the real tables ---------------------------------------------------------------------------------


def _tables():
    tables = []
    if _importable("transformers", "accelerate"):
        from zerofast.integrations import accelerate, hf

        tables.append(accelerate.RELIES_ON)
        tables.append(hf.RELIES_ON)
        if _importable("trl"):
            from zerofast.integrations import _trl

            tables.append(_trl.RELIES_ON)
        if _importable("peft"):
            from zerofast.integrations import peft_weights

            tables.append(peft_weights.RELIES_ON)
    if _importable("lightning"):
        from zerofast.integrations import lightning

        tables.append(lightning.RELIES_ON)
    if _importable("pytorch_lightning"):
        from zerofast.integrations import pytorch_lightning

        tables.append(pytorch_lightning.RELIES_ON)
    if _importable("torchft"):
        from zerofast.integrations import torchft

        tables.append(torchft.RELIES_ON)
    return tables


def _importable(*names):
    import importlib.util

    return all(importlib.util.find_spec(n) is not None for n in names)


def test_the_real_tables_pass_on_the_pinned_versions_without_a_warning():
    tables = _tables()
    if not tables:
        pytest.skip("no integration's host is installed (the Makefile pins them)")
    for table in tables:
        with _no_warning():
            hosts.check(table)


def test_the_real_trainer_table_names_a_renamed_private_method():
    pytest.importorskip("transformers")
    from transformers import Trainer

    from zerofast.integrations import hf

    # Trainer as a release that renamed _save_checkpoint would have it: the same members, that one renamed.
    members = {k: v for k, v in vars(Trainer).items() if k not in ("__dict__", "__weakref__", "_save_checkpoint")}
    members["_save_checkpoint_to"] = vars(Trainer)["_save_checkpoint"]
    renamed = type("Trainer", Trainer.__bases__, members)
    reliance = hosts.Reliance(
        "zerofast.integrations.hf",
        "hf",
        (hf.TRANSFORMERS,),
        (hosts.Overrides(hf.ZeroTrainerMixin, renamed, hf.TRAINER_OVERRIDES),),
    )
    with pytest.raises(hosts.IncompatibleHostError) as caught:
        hosts.check(reliance, versions={"transformers": "5.24.0"})
    message = str(caught.value)
    assert "transformers.trainer.Trainer._save_checkpoint: missing (ZeroTrainerMixin overrides it)" in message
    assert message.count("\n  - ") == 1 and "written and tested against transformers 5.24.0" in message


def test_the_real_strategy_table_names_a_changed_signature():
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import DDPStrategy

    from zerofast.integrations import _lightning

    class ChangedStrategy(DDPStrategy):  # as if a release added an argument to save_checkpoint
        def save_checkpoint(self, checkpoint, filepath, storage_options=None, *, async_=False):
            pass

    reliance = hosts.Reliance(
        "zerofast.integrations.lightning",
        "lightning",
        (hosts.Pin("lightning", "2.6.6", ">=2.6.6,<2.7"),),
        (hosts.Overrides(_lightning.ZeroStrategyMixin, ChangedStrategy, ("save_checkpoint",)),),
    )
    with pytest.raises(hosts.IncompatibleHostError, match=r"does not take async_= \(by keyword\)"):
        hosts.check(reliance, versions={"lightning": "2.6.6"})


def test_the_tables_agree_with_the_extras_and_the_makefile_pins():
    tomllib = pytest.importorskip("tomllib")
    tables = _tables()
    if not tables:
        pytest.skip("no integration's host is installed (the Makefile pins them)")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    with open(os.path.join(ROOT, "Makefile")) as f:  # the main venv's pins (not the oldest torch's job)
        main = "".join(line for line in f if not line.startswith("OLDEST_"))
    pinned = dict(re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', main))
    pins = [(table.extra, pin) for table in tables for pin in table.pins]
    if _importable("trl"):
        from zerofast.integrations import _trl

        pins.append(("hf", _trl.TRL))
    for extra, pin in pins:
        assert f"{pin.distribution}{pin.supported}" in extras[extra], (extra, pin, extras[extra])
        assert pinned[pin.distribution] == pin.tested, (pin, pinned.get(pin.distribution))
    for extra in ("hf", "lightning", "pytorch-lightning", "torchft"):  # every extra a range, never one version
        assert all("==" not in r and "<" in r and ">=" in r for r in extras[extra]), extras[extra]
