"""Budget profiles: the versioned, validated file that carries calibrated head budgets to the engine.

A profile holds, per (layer, KV head), the mean and std of the head's implicit retention under the
dynamic method over the pilot samples and its static budget ``b = min(1, mean + lambda * std)``;
the head grouping (``head_perm``, ``group_budgets``) for one group size; the fingerprint of the
model it was calibrated on; and how/when it was made. JSON layout (format_version 1)::

    {"format_version": 1,
     "model": {"name", "architecture", "num_layers", "num_kv_heads", "head_dim", ...},
     "method": "snapkv", "rho": 0.25, "lambda": 2.0, "safeguard": 0.2, "rescaled": false,
     "group_size": 3, "grouping": "budget",
     "heads": {"mean": [[...]], "std": [[...]], "budget": [[...]]},        # [layers, kv_heads]
     "groups": {"head_perm": [[...]], "group_budgets": [[...]]},           # [layers, ...]
     "metadata": {"created", "samples", "tangram_jax_version", "git_revision", "device", ...}}

Format version 2 adds precision-tier budgets (hetero-precision KV, `kv_layout.TieredLayout`)::

     "tiers": {"precision": "k8v4-k4v2", "mass": 0.9, "lambda": 2.0,
               "mean": [[...]], "std": [[...]], "high_share": [[...]]}    # [layers, kv_heads]

per head the mean and std over the pilot samples of the share of its retained tokens that the
high tier holds (`calibration.high_tier_share`) and the static share ``min(1, mean + lambda *
std)``; a group's share is the max of its members' (as its budget is). A profile without tiers
is written as version 1 (what older readers read); both versions are read.
`BudgetProfile.load` rejects anything it cannot trust with a ValueError naming the problem.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
from pathlib import Path

import numpy as np

from tangram_jax.compression.clustering import GROUPINGS, group_heads
from tangram_jax.kv_layout import PRECISION_TIERS, KVLayout, TieredLayout
from tangram_jax.provenance import device_description, git_revision
from tangram_jax.version import __version__

FORMAT_VERSION = 2            # written when the profile has tiers, else 1
READ_VERSIONS = (1, 2)
FINGERPRINT_KEYS = ("architecture", "num_layers", "num_kv_heads", "head_dim")
PROFILES_DIR = Path(__file__).parent / "profiles"
# The embedded model's shipped profiles: calibrated with SnapKV (Ada-SnapKV selection).
EMBEDDED_MODEL_NAME = "smollm2"  # tangram_jax.models.registry's name for it


class ProfileError(ValueError):
    """A profile file that is malformed, inconsistent, or made for another model."""


def creation_metadata(samples: int, **extra) -> dict:
    """Date, sample count, package version, git revision (when the package is in a checkout)
    and the device the calibration ran on."""
    meta = dict(created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                samples=int(samples), tangram_jax_version=__version__, git_revision=git_revision(),
                device=device_description())
    meta.update(extra)
    return meta


@dataclasses.dataclass(frozen=True, eq=False)
class TierBudgets:
    """Calibrated precision-tier budgets, per (layer, KV head): mean/std of the high tier's share
    of the head's retained tokens over the pilot samples, and the static share ``high_share =
    min(1, mean + lambda * std)`` (float64 [layers, kv_heads], all in [0, 1]); `mass`: the
    share of the retained set's importance the high tier had to hold when calibrated."""

    precision: str
    mass: float
    lambda_: float
    mean: np.ndarray
    std: np.ndarray
    high_share: np.ndarray

    def to_dict(self) -> dict:
        return {"precision": self.precision, "mass": self.mass, "lambda": self.lambda_,
                "mean": self.mean.tolist(), "std": self.std.tolist(),
                "high_share": self.high_share.tolist()}

    @classmethod
    def from_dict(cls, d) -> "TierBudgets":
        if not isinstance(d, dict):
            raise ProfileError(f"profile field 'tiers' must be an object, got {type(d).__name__}")
        try:
            return cls(precision=d["precision"], mass=_number(d, "mass"),
                       lambda_=_number(d, "lambda"), mean=_array(d, "mean", np.float64),
                       std=_array(d, "std", np.float64),
                       high_share=_array(d, "high_share", np.float64))
        except KeyError as e:
            raise ProfileError(f"profile tiers lack field {e.args[0]!r}") from None


@dataclasses.dataclass(frozen=True, eq=False)
class BudgetProfile:
    """Calibrated budgets of one model. Arrays: mean/std/budget float64 [layers, kv_heads],
    head_perm int32 [layers, kv_heads], group_budgets float64 [layers, kv_heads // group_size]."""

    model: dict
    method: str
    rho: float
    lambda_: float
    mean: np.ndarray
    std: np.ndarray
    budget: np.ndarray
    group_size: int
    grouping: str
    head_perm: np.ndarray
    group_budgets: np.ndarray
    safeguard: float = 0.2
    rescaled: bool = False
    metadata: dict = dataclasses.field(default_factory=dict)
    tiers: TierBudgets | None = None

    def __post_init__(self):
        _validate(self)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_budgets(cls, *, model: dict, method: str, rho: float, lambda_: float, mean, std, budget,
                     group_size: int, grouping: str = "budget", **kwargs) -> "BudgetProfile":
        """Groups the heads (`clustering.group_heads`) and builds the profile."""
        budget = np.asarray(budget, dtype=np.float64)
        perm, group_budgets = group_heads(budget, group_size, grouping)
        return cls(model=dict(model), method=method, rho=float(rho), lambda_=float(lambda_),
                   mean=np.asarray(mean, np.float64), std=np.asarray(std, np.float64),
                   budget=budget, group_size=int(group_size), grouping=grouping, head_perm=perm,
                   group_budgets=group_budgets, **kwargs)

    @classmethod
    def uniform(cls, model: dict, ratio: float, *, method: str = "snapkv",
                group_size: int = 1) -> "BudgetProfile":
        """Every head keeps the same share `ratio`: the uniform per-head top-k baseline, served
        by tangram mode like any calibrated profile. `model` is the fingerprint
        (`ModelConfig.fingerprint()`); nothing is calibrated, so mean = budget = ratio, std = 0."""
        for key in ("num_layers", "num_kv_heads"):
            if key not in model:
                raise ProfileError(f"model fingerprint lacks {key!r}: {model}")
        if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ProfileError(f"ratio must lie in (0, 1], got {ratio!r}")
        shape = (int(model["num_layers"]), int(model["num_kv_heads"]))
        budget = np.full(shape, float(ratio))
        return cls.from_budgets(model=model, method=method, rho=float(ratio), lambda_=0.0,
                                mean=budget, std=np.zeros(shape), budget=budget,
                                group_size=group_size,
                                metadata=creation_metadata(0, kind="uniform"))

    def regroup(self, group_size: int, grouping: str = "budget") -> "BudgetProfile":
        """The same budgets grouped with another G or grouping rule."""
        perm, group_budgets = group_heads(self.budget, group_size, grouping)
        return dataclasses.replace(self, group_size=int(group_size), grouping=grouping,
                                   head_perm=perm, group_budgets=group_budgets)

    def to_layout(self, page_size: int, chunk_size: int) -> KVLayout:
        return KVLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                        head_dim=int(self.model["head_dim"]), group_size=self.group_size,
                        page_size=page_size, chunk_size=chunk_size, head_perm=self.head_perm,
                        group_budgets=self.group_budgets,
                        name="tangram" if self.grouping == "budget" else self.grouping)

    def group_high_share(self) -> np.ndarray:
        """float64 [layers, groups]: each group's high-tier share, the max of its members'."""
        if self.tiers is None:
            raise ProfileError("the profile carries no precision tiers (calibrate with tiers)")
        members = np.take_along_axis(self.tiers.high_share, self.head_perm.astype(np.int64),
                                     axis=1)
        return members.reshape(self.num_layers, -1, self.group_size).max(axis=2)

    def to_tiered_layout(self, page_size: int, chunk_size: int) -> TieredLayout:
        """The layout of this profile with its precision tiers (`kv_layout.TieredLayout`)."""
        return TieredLayout(self.to_layout(page_size, chunk_size), self.group_high_share(),
                            precision=self.tiers.precision if self.tiers else "k8v4-k4v2")

    @property
    def num_layers(self) -> int:
        return int(self.model["num_layers"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.model["num_kv_heads"])

    # -- files ----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        d = {
            "format_version": FORMAT_VERSION if self.tiers is not None else 1,
            "model": dict(self.model),
            "method": self.method,
            "rho": self.rho,
            "lambda": self.lambda_,
            "safeguard": self.safeguard,
            "rescaled": self.rescaled,
            "group_size": self.group_size,
            "grouping": self.grouping,
            "heads": {"mean": self.mean.tolist(), "std": self.std.tolist(),
                      "budget": self.budget.tolist()},
            "groups": {"head_perm": self.head_perm.tolist(),
                       "group_budgets": self.group_budgets.tolist()},
            "metadata": dict(self.metadata),
        }
        if self.tiers is not None:
            d["tiers"] = self.tiers.to_dict()
        return d

    def save(self, path: str | os.PathLike) -> None:
        """Writes the JSON with one array row per line (readable diffs, modest size)."""
        d = self.to_dict()
        rows = {}
        for section in ("heads", "groups", "tiers"):
            for key, value in d.get(section, {}).items():
                if not isinstance(value, list):
                    continue
                marker = f"@@{section}.{key}@@"
                rows[marker] = "[\n    " + ",\n    ".join(json.dumps(r) for r in value) + "\n   ]"
                d[section][key] = marker
        text = json.dumps(d, indent=1)
        for marker, block in rows.items():
            text = text.replace(json.dumps(marker), block)
        Path(path).write_text(text + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, d: dict, expected_fingerprint: dict | None = None) -> "BudgetProfile":
        if not isinstance(d, dict):
            raise ProfileError(f"profile must be a JSON object, got {type(d).__name__}")
        version = d.get("format_version")
        if version not in READ_VERSIONS or isinstance(version, bool):
            raise ProfileError(f"unknown profile format_version {version!r} "
                               f"(this tangram_jax reads versions {READ_VERSIONS})")
        if (version == 2) != ("tiers" in d):
            raise ProfileError(f"profile format_version {version} "
                               f"{'needs' if version == 2 else 'has no'} a 'tiers' section")
        try:
            heads, groups = d["heads"], d["groups"]
            rescaled = d.get("rescaled", False)
            if not isinstance(rescaled, bool):
                raise ProfileError(f"profile field 'rescaled' must be true or false, got {rescaled!r}")
            metadata = d.get("metadata", {})
            if not isinstance(metadata, dict):
                raise ProfileError(f"profile field 'metadata' must be an object, got "
                                   f"{type(metadata).__name__}")
            profile = cls(
                model=d["model"], method=d["method"], rho=_number(d, "rho"),
                lambda_=_number(d, "lambda"), safeguard=_number(d, "safeguard", 0.2),
                rescaled=rescaled,
                mean=_array(heads, "mean", np.float64), std=_array(heads, "std", np.float64),
                budget=_array(heads, "budget", np.float64), group_size=d["group_size"],
                grouping=d["grouping"], head_perm=_array(groups, "head_perm", np.int64),
                group_budgets=_array(groups, "group_budgets", np.float64),
                metadata=metadata,
                tiers=TierBudgets.from_dict(d["tiers"]) if "tiers" in d else None)
        except KeyError as e:
            raise ProfileError(f"profile is missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ProfileError):
                raise
            raise ProfileError(f"profile has a malformed field: {e}") from None
        if expected_fingerprint is not None:
            profile.check_fingerprint(expected_fingerprint)
        return profile

    @classmethod
    def load(cls, path: str | os.PathLike, expected_fingerprint: dict | None = None) -> "BudgetProfile":
        """Reads and validates a profile; with `expected_fingerprint` also checks it is for that model."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ProfileError(f"cannot read profile {path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ProfileError(f"profile {path} is not UTF-8 text (byte {e.object[e.start]:#04x} "
                               f"at offset {e.start}); a profile is a JSON file") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"profile {path} is not valid JSON: {e}") from None
        except RecursionError:
            raise ProfileError(f"profile {path} nests JSON too deeply to be a profile") from None
        try:
            return cls.from_dict(d, expected_fingerprint)
        except ProfileError as e:
            raise ProfileError(f"{path}: {e}") from None
        except RecursionError:
            raise ProfileError(f"{path}: a profile field nests too deeply") from None

    def check_fingerprint(self, expected: dict) -> None:
        """Raises ProfileError if `expected` (e.g. `ModelConfig.fingerprint()`) names another model.

        Every key present in both is compared (the shape keys are always present in a profile),
        except the `name`, which is a label (an alias or a path that differs between machines).
        """
        diffs = [f"{k}: profile {self.model[k]!r} vs model {expected[k]!r}"
                 for k in expected
                 if k != "name" and k in self.model and self.model[k] != expected[k]]
        if diffs:
            raise ProfileError("profile was calibrated for a different model (" + "; ".join(diffs)
                               + ")")


def _number(d: dict, key: str, default: float | None = None) -> float:
    value = d.get(key, default) if default is not None else d[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"profile field {key!r} must be a number, got {value!r}")
    return float(value)


def _array(section, key, dtype) -> np.ndarray:
    if not isinstance(section, dict):
        raise ProfileError(f"profile section holding {key!r} must be an object")
    value = section[key]
    try:
        arr = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise ProfileError(f"profile field {key!r} is not a numeric [layers, ...] array: {e}") from None
    if arr.ndim != 2:
        raise ProfileError(f"profile field {key!r} must be a 2-D array, got shape {arr.shape}")
    return arr


def _validate(p: BudgetProfile) -> None:
    if not isinstance(p.model, dict):
        raise ProfileError("profile 'model' must be an object")
    missing = [k for k in FINGERPRINT_KEYS if k not in p.model]
    if missing:
        raise ProfileError(f"profile model fingerprint lacks {missing}")
    for k in ("num_layers", "num_kv_heads", "head_dim"):
        v = p.model[k]
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ProfileError(f"profile model {k} must be a positive int, got {v!r}")
    layers, heads = p.num_layers, p.num_kv_heads
    if not isinstance(p.method, str) or not p.method:
        raise ProfileError(f"profile method must be a non-empty string, got {p.method!r}")
    for name, value, lo_open in (("rho", p.rho, True), ("safeguard", p.safeguard, False)):
        if not (math.isfinite(value) and (0 < value <= 1 if lo_open else 0 <= value <= 1)):
            raise ProfileError(f"profile {name} must lie in {'(0, 1]' if lo_open else '[0, 1]'}, "
                               f"got {value}")
    if not (math.isfinite(p.lambda_) and p.lambda_ >= 0):
        raise ProfileError(f"profile lambda must be a finite number >= 0, got {p.lambda_}")
    g = p.group_size
    if not isinstance(g, (int, np.integer)) or isinstance(g, bool) or g <= 0 or heads % g:
        raise ProfileError(f"profile group_size {g!r} must be a positive divisor of "
                           f"num_kv_heads {heads}")
    if p.grouping not in GROUPINGS:
        raise ProfileError(f"profile grouping {p.grouping!r} is not one of {GROUPINGS}")
    for name, arr, shape in (("mean", p.mean, (layers, heads)), ("std", p.std, (layers, heads)),
                             ("budget", p.budget, (layers, heads)),
                             ("head_perm", p.head_perm, (layers, heads)),
                             ("group_budgets", p.group_budgets, (layers, heads // g))):
        if np.shape(arr) != shape:
            raise ProfileError(f"profile {name} has shape {np.shape(arr)}, expected {shape} for "
                               f"{layers} layers x {heads} KV heads, group size {g}")
        if not np.isfinite(arr).all():
            raise ProfileError(f"profile {name} contains NaN or infinite values")
    for name, arr in (("budget", p.budget), ("group_budgets", p.group_budgets)):
        bad = ~((arr > 0) & (arr <= 1))
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ProfileError(f"profile {name} must lie in (0, 1]; {name}{list(idx)} = {arr[idx]}")
    if ((p.mean < 0) | (p.mean > 1)).any() or (p.std < 0).any():
        raise ProfileError("profile mean must lie in [0, 1] and std must be >= 0")
    perm = np.asarray(p.head_perm)
    if not (np.sort(perm, axis=1) == np.arange(heads)).all():
        raise ProfileError("profile head_perm is not a permutation of the KV heads in every layer")
    members = np.take_along_axis(p.budget, perm.astype(np.int64), axis=1)
    expected = members.reshape(layers, heads // g, g).max(axis=2)
    if not np.allclose(expected, p.group_budgets, rtol=0, atol=1e-9):
        raise ProfileError("profile group_budgets are not the max of their members' budgets")
    object.__setattr__(p, "head_perm", perm.astype(np.int32))
    if p.tiers is not None:
        _validate_tiers(p.tiers, (layers, heads))


def _validate_tiers(t: TierBudgets, shape: tuple[int, int]) -> None:
    if not isinstance(t, TierBudgets):
        raise ProfileError(f"profile tiers must be TierBudgets, got {type(t).__name__}")
    if t.precision not in PRECISION_TIERS:
        raise ProfileError(f"profile tiers precision {t.precision!r} is not one of "
                           f"{tuple(PRECISION_TIERS)}")
    if not (math.isfinite(t.mass) and 0 < t.mass <= 1):
        raise ProfileError(f"profile tiers mass must lie in (0, 1], got {t.mass}")
    if not (math.isfinite(t.lambda_) and t.lambda_ >= 0):
        raise ProfileError(f"profile tiers lambda must be a finite number >= 0, got {t.lambda_}")
    for name in ("mean", "std", "high_share"):
        arr = np.asarray(getattr(t, name))
        if arr.shape != shape:
            raise ProfileError(f"profile tiers {name} has shape {arr.shape}, expected {shape} "
                               f"[layers, kv_heads]")
        if not np.isfinite(arr).all():
            raise ProfileError(f"profile tiers {name} contains NaN or infinite values")
    for name in ("mean", "high_share"):
        arr = np.asarray(getattr(t, name))
        if ((arr < 0) | (arr > 1)).any():
            idx = tuple(int(i) for i in np.argwhere((arr < 0) | (arr > 1))[0])
            raise ProfileError(f"profile tiers {name} must lie in [0, 1]; {name}{list(idx)} = "
                               f"{arr[idx]}")
    if (np.asarray(t.std) < 0).any():
        raise ProfileError("profile tiers std must be >= 0")


def shipped_profile_path(rho: float, group_size: int, tiers: str | None = None) -> Path:
    suffix = f"_{tiers}" if tiers else ""
    return PROFILES_DIR / f"smollm2-135m_snapkv_rho{rho:.2f}_g{group_size}{suffix}.json"


def shipped_profile(rho: float, group_size: int, expected_fingerprint: dict | None = None, *,
                    tiers: str | None = None) -> BudgetProfile:
    """The calibrated profile shipped for the embedded SmolLM2-135M (rho 0.5 / 0.25, G 1 / 3);
    with `tiers` (a `kv_layout.PRECISION_TIERS` name) the one calibrated with its tier budgets
    (same pilot samples and seed, so the same budgets)."""
    path = shipped_profile_path(rho, group_size, tiers)
    if not path.exists():
        available = sorted(q.name for q in PROFILES_DIR.glob("*.json"))
        raise ValueError(f"no shipped profile for rho={rho}, group_size={group_size}; shipped: "
                         f"{available}")
    return BudgetProfile.load(path, expected_fingerprint)
