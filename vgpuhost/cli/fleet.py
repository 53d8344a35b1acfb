"""`vgpuhost fleet capacity|place`: where does a vGPU fit in the fleet? (read from Prometheus)

Logic lives in :mod:`vgpuhost.ops.fleet` (the series) and
:mod:`vgpuhost.policy.fleet` (the ranking); this module parses options and
prints.  ``place`` exits 1 when no host can take the request.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import click

from ..model.kinds import PlacementStrategy
from ..ops.fleet import host_facts
from ..policy.fleet import capacity, rank
from .common import Finite, current, emit
from .output import table

PROM_HELP = "Prometheus's base URL (http://HOST:9090) scraping every host's agent (--metrics-port)."


@click.group("fleet")
def fleet() -> None:
    """The fleet's capacity and placement, from the agents' series in Prometheus."""


@fleet.command("capacity")
@click.option("--prometheus", "url", required=True, metavar="URL", help=PROM_HELP)
@click.option("--profile", metavar="NAME", help="Only this vGPU profile.")
@click.option("--job", metavar="JOB", help="Only scrape targets of this Prometheus job.")
@click.option("--stale", type=Finite(1, 86400), default=120.0, show_default=True, metavar="S",
              help="A host whose last sample is older than S seconds is skipped.")
@click.option("--tenant", metavar="T", help="What each host's admission would admit for this tenant now.")
def fleet_capacity(url: str, profile: Optional[str], job: Optional[str], stale: float, tenant: Optional[str]) -> None:
    """Free instances per profile and host (healthy hosts only).

    With --tenant T: what each host's admission would admit for T's domains
    now (its vgpuhost_tenant_free_instances); a tenant no host knows is
    refused (exit 2) while hosts know tenants.
    """
    doc = capacity(host_facts(url, job=job, stale_s=stale), profile, tenant)
    rows = [[p["profile"], p["total"], " ".join(f"{h}={n}" for h, n in p["by_host"].items())] for p in doc["profiles"]]
    text = table(["PROFILE", "FREE", "BY_HOST"], rows) if rows else "no free capacity"
    text += "".join(f"\nskipped {s['instance']}: {s['why']}" for s in doc["skipped"])
    emit(current(), doc, text)


@fleet.command("place")
@click.option("--prometheus", "url", required=True, metavar="URL", help=PROM_HELP)
@click.option("--profile", required=True, metavar="NAME", help="The vGPU profile to place.")
@click.option("--tenant", metavar="T", help="Only hosts whose admission would admit this tenant's vGPU now.")
@click.option("--strategy", default=PlacementStrategy.DEFAULT, show_default=True,
              type=click.Choice(PlacementStrategy.FITTING))
@click.option("--job", metavar="JOB", help="Only scrape targets of this Prometheus job.")
@click.option("--stale", type=Finite(1, 86400), default=120.0, show_default=True, metavar="S",
              help="A host whose last sample is older than S seconds is skipped.")
def fleet_place(url: str, profile: str, tenant: Optional[str], strategy: str, job: Optional[str],
                stale: float) -> None:
    """Rank the hosts that can take one PROFILE vGPU now; the first is the choice.  Exit 1: none can.

    With --tenant T a host counts what its admission would admit for T now
    (quota, isolation, QoS class, pools, reserves, placement); a host where
    it would refuse is skipped with why.  A tenant no host knows is refused
    (exit 2) while hosts know tenants.
    """
    r = rank(host_facts(url, job=job, stale_s=stale), profile, strategy=strategy, tenant=tenant)
    lines = [f"{i}. {h} ({n} free)" for i, (h, n) in enumerate(r.hosts, 1)] or [f"no host can take {profile}"]
    lines += [f"skipped {h}: {why}" for h, why in r.skipped]
    emit(current(), r.as_dict(), "\n".join(lines))
    sys.exit(0 if r.hosts else 1)


COMMANDS: List[click.Command] = [fleet]
