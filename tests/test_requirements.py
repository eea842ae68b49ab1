"""requirements.txt and requirements-test.txt against torch's own dependencies, so that the README's two pip commands
resolve wherever torch installs (Linux with PyPI's CUDA build or PyTorch's CPU build, macOS, Python 3.11 to 3.13):

- every package that torch pins exactly, we pin exactly as torch does (version and environment marker), and every
  exact pin of ours is a version torch allows: for torch 2.13.0 as PyPI publishes it for Linux (its Requires-Dist,
  recorded in tests/data/torch-<version>-linux-requires.txt from PyPI's metadata) and for the torch installed here,
  whichever build it is (a triton pin other than torch's made pip stop with ResolutionImpossible on Linux);
- the record is of the torch version requirements.txt pins, so a new torch pin asks for a new record;
- triton is asked for on Linux only, where torch's CUDA build brings it and the CPU build leaves it to us: macOS and
  Windows, which have no triton, install without it (and the Triton tests skip there, saying so).
"""

import importlib.metadata

import pytest
from conftest import DATA, ROOT
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def pins(name):
    """{package: Requirement} of a requirements file, the files it includes with -r too."""
    found = {}
    for line in open(f"{ROOT}/{name}").read().splitlines():
        line = line.split("#")[0].strip()  # markers hold no "#"
        if line.startswith("-r "):
            found |= pins(line[3:].strip())
        elif line:
            requirement = Requirement(line)
            found[canonicalize_name(requirement.name)] = requirement
    return found


OURS = pins("requirements-test.txt")
TORCH = next(iter(OURS["torch"].specifier)).version  # requirements.txt pins torch exactly


def recorded_linux_torch():
    lines = (DATA / f"torch-{TORCH}-linux-requires.txt").read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def installed_torch():
    return importlib.metadata.requires("torch") or []


def exact(requirement):
    """The version a requirement pins with ==, else None."""
    return next((s.version for s in requirement.specifier if s.operator == "=="), None)


@pytest.mark.parametrize("torch_requires", [recorded_linux_torch, installed_torch], ids=["pypi-linux", "installed"])
def test_our_pins_agree_with_torchs(torch_requires):
    """What torch pins exactly, we pin as torch does (the same version under the same marker); what we pin exactly,
    torch allows. Extras' requirements (extra == "...") are not installed by `pip install torch` and are left out."""
    theirs = [Requirement(r) for r in torch_requires() if "extra ==" not in r]
    assert theirs or torch_requires is installed_torch  # the record holds torch's requirements
    for req in theirs:
        ours = OURS.get(canonicalize_name(req.name))
        if ours is None:
            continue
        if exact(req):
            assert (ours.specifier, ours.marker) == (req.specifier, req.marker), f"{ours} against torch's {req}"
        if exact(ours):
            assert req.specifier.contains(exact(ours), prereleases=True), f"{ours} against torch's {req}"


def test_the_record_is_of_the_pinned_torch():
    """requirements.txt pins torch exactly, and tests/data holds that very version's requirements."""
    assert str(OURS["torch"].specifier) == f"=={TORCH}" and recorded_linux_torch()
    assert any(r.startswith("triton==") for r in recorded_linux_torch())  # the Linux build brings triton


@pytest.mark.parametrize("python", ["3.11", "3.12", "3.13"])
def test_triton_is_asked_for_on_linux_only(python):
    """Our triton requirement applies on Linux and on no other system, for each Python the README names."""
    marker = OURS["triton"].marker or Marker("python_version > '0'")
    for system, wanted in (("Linux", True), ("Darwin", False), ("Windows", False)):
        assert marker.evaluate({"platform_system": system, "python_version": python}) == wanted, system
