"""Records what tfdist's fixes were verified against: every target's signature and code hash.

Run it once per verified release pair (each nox session of ``noxfile.py``, after its tests
pass): it adds the installed releases' records to ``tfdist/core/fingerprints.json``, keeps
the other releases' records, and drops the entries no target names any more (a retired fix's). ``tfdist.core.fix_registry.guard`` reads the file: a target whose
signature is not a recorded one, or (outside the verified range) whose code is not a
recorded one, makes its fix step aside with a warning.

    python tools/fix_fingerprints.py           # add this environment's records
    python tools/fix_fingerprints.py --check   # exit 1 if the file lacks them (CI)
"""

from __future__ import annotations

import argparse
import json
import sys

from tfdist import compat, startup, unscoped
from tfdist.core import fix_registry, versions


def _minor(package: str) -> str:
    version = versions.installed(package) or "0.0"
    return f"{package} {'.'.join(version.split('.')[:2])}"


def patches() -> tuple[fix_registry.Fix | fix_registry.Patch, ...]:
    """Every record fix_registry.apply_fix applies: the fixes and tfdist's own hooks."""
    return (*compat.FIXES, *compat.HOOKS, startup.STARTUP, unscoped.HOOK)


def target_entries() -> set[str]:
    """The entries the targets name (an instance attribute is checked in the source)."""
    return {t.entry for fix in patches() for t in fix.targets if not t.instance}


def current_records() -> dict[str, dict[str, dict]]:
    """``{entry: {"keras 3.15": {"signature": ..., "code": ...}}}`` for this environment."""
    records: dict[str, dict[str, dict]] = {}
    for fix in patches():
        for target in fix.targets:
            found = fix_registry.record(target)
            if found is not None:
                records[target.entry] = {_minor(target.package): found}
    return records


def merged(existing: dict, new: dict, named: set[str]) -> dict:
    """``existing`` with ``new``'s records added, less the entries not in ``named``."""
    out = {entry: dict(versions_) for entry, versions_ in existing.items() if entry in named}
    for entry, by_version in new.items():
        out.setdefault(entry, {}).update(by_version)
    return {entry: dict(sorted(out[entry].items())) for entry in sorted(out)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if records are missing")
    args = parser.parse_args(argv)
    existing = fix_registry.verified_fingerprints()
    new = current_records()
    result = merged(existing, new, target_entries())
    if args.check:
        if result != existing:
            missing = sorted(e for e in result if result[e] != existing.get(e))
            unnamed = sorted(set(existing) - set(result))
            print(
                f"fix_fingerprints: no record for this environment of {missing}; no target names {unnamed}"
            )
            return 1
        print(f"fix_fingerprints: {len(existing)} targets recorded")
        return 0
    fix_registry.FINGERPRINTS_FILE.write_text(json.dumps(result, indent=1) + "\n")
    print(f"fix_fingerprints: wrote {len(result)} targets to {fix_registry.FINGERPRINTS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
