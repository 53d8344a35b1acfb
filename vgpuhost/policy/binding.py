"""Whose a domain is: the operator's binding against what the domain XML asks (issue 28).

Owns: :func:`trusted`, the one decision of a start's tenant and QoS class
from what is trusted (the operator's binding in the state store, or, with the
OpenStack mapping on, the project Nova wrote) and what the domain's vgpuhost
metadata asks (``tenant=``, ``qos=``: it may ask, never claim), and
:func:`weaker` / :func:`stronger` over QoS classes.  Must not: read the
store or libvirt (:mod:`vgpuhost.ops.tenancy` gathers the facts), or decide
quota, pools or placement (:mod:`vgpuhost.policy.admission`).

The rules (docs/guide/tenancy.md, "Trust model"):

- a binding names the tenant; without one, the OpenStack mapping (when on)
  names the Nova project, and a domain whose ``<nova:project>`` is missing
  or empty is refused; without either the domain is *unbound*: best effort,
  no tenant, no guarantee (refused when the operator requires a binding);
- metadata naming another tenant than the trusted one is refused; metadata
  naming a tenant on an unbound domain is ignored (never counted or billed
  to it);
- the class allowed is the binding's (when it names one) capped at the
  tenant's class, best effort for an unbound domain or a tenant not known;
  metadata asking a stronger class is refused, a weaker one is granted.
"""

from __future__ import annotations

from ..model.tenancy import QOS_CLASSES, UNTENANTED_QOS
from ..model.values import record

TYPE_CHECKING = False
if TYPE_CHECKING:       # annotations only (the qemu hook does not import typing)
    from typing import Optional, Sequence, Tuple

#: binding sources (:attr:`Trusted.source`)
BINDING, OPENSTACK, UNBOUND = "binding", "openstack", "unbound"


def stronger(a: str, b: str) -> bool:
    """Is QoS class ``a`` stronger than ``b`` (``guaranteed`` > ``burstable`` > ``best-effort``)?"""
    return QOS_CLASSES.index(a) < QOS_CLASSES.index(b)


def weaker(a: Optional[str], b: Optional[str]) -> Optional[str]:
    """The weaker of two QoS classes (None: no bound on that side)."""
    if a is None:
        return b
    if b is None:
        return a
    return b if stronger(a, b) else a


@record(frozen=True)
class Trusted:
    """A start's tenant and QoS class as the operator allows them.

    ``tenant``: the tenant's name (None: unbound, no tenant); ``qos``: the class the start runs in;
    ``source``: :data:`BINDING`, :data:`OPENSTACK` or :data:`UNBOUND`; ``text``: the binding in words for
    lines and audit rows (``bound to tenant 'a' by cli uid=0 pid=7 at 2026-12-06T21:00:00``);
    ``refusal`` / ``hint``: why the start is refused ('' when it is not)."""

    tenant: Optional[str]
    qos: str
    source: str
    text: str
    refusal: str = ""
    hint: str = ""


def binding_text(row: Optional[Sequence]) -> str:
    """A binding row ``(domain, tenant, qos, bound_by, time)`` in words."""
    if row is None:
        return "bound to no tenant"
    qos = f" with QoS class {row[2]}" if row[2] else ""
    return f"bound to tenant {row[1]!r}{qos} by {row[3]} at {str(row[4])[:19]}"


def trusted(domain: str, *, binding: Optional[Sequence], asked_tenant: Optional[str], asked_qos: Optional[str],
            tenant_class: Optional[str], openstack: Optional[str] = None,
            nova_project: Optional[Tuple[str, Optional[str]]] = None, require_binding: bool = False) -> Trusted:
    """Decide a start's tenant and class (module docstring).

    ``domain``: its name, for the lines; ``binding``: its row ``(domain, tenant, qos, bound_by, time)``
    or None; ``asked_tenant`` / ``asked_qos``: its vgpuhost metadata's ``tenant=`` / ``qos=``;
    ``tenant_class``: the trusted tenant's class (None: no such tenant); ``openstack``: the mapping
    (``project-name`` / ``project-uuid``, None: off); ``nova_project``: ``(name, UUID)`` from Nova's
    metadata; ``require_binding``: the operator's ``require-binding`` setting.  Never raises: a
    refusal is :attr:`Trusted.refusal`."""
    bind = f"'vgpuhost tenant bind {domain} {asked_tenant or 'TENANT'}'"
    tenant: Optional[str] = None
    if binding is not None:
        tenant, source, text = binding[1], BINDING, binding_text(binding)
        cap = binding[2]
    elif openstack:
        name, uuid = nova_project if nova_project is not None else ("", None)
        tenant = (uuid if openstack == "project-uuid" else name) or None
        source, cap = OPENSTACK, None
        text = f"bound by the OpenStack mapping ({openstack}) to Nova's project {tenant!r}"
        if tenant is None:
            what = "missing" if nova_project is None else ("empty" if openstack == "project-name" else "without uuid=")
            return Trusted(None, UNTENANTED_QOS, source, "bound to no tenant",
                           f"domain {domain!r} has GPU devices and the OpenStack mapping ({openstack}) is on, but its "
                           f"Nova metadata's <nova:project> is {what}: no tenant can be trusted for it",
                           f"Nova writes <nova:owner><nova:project> for the instances it starts; a domain Nova does "
                           f"not manage needs an operator's binding: {bind}; nothing was changed")
    else:
        source, cap, text = UNBOUND, None, "bound to no tenant"
        if require_binding:
            return Trusted(None, UNTENANTED_QOS, source, text,
                           f"domain {domain!r} is bound to no tenant, and the operator requires a binding "
                           "(require-binding on)",
                           f"bind it: {bind} (or 'vgpuhost tenant policy --require-binding off'); nothing was "
                           "changed")
    if tenant is not None and asked_tenant and asked_tenant.lower() != tenant.lower():
        return Trusted(tenant, UNTENANTED_QOS, source, text,
                       f"domain {domain!r}: its metadata names tenant {asked_tenant!r}, but it is {text}: a domain's "
                       "metadata may ask, never claim, a tenant",
                       f"an operator binds it: 'vgpuhost tenant bind {domain} {asked_tenant}', or remove tenant= "
                       "from its metadata; nothing was changed")
    allowed = weaker(cap, tenant_class if tenant is not None and tenant_class else UNTENANTED_QOS)
    if asked_qos and stronger(asked_qos, allowed):
        whose = f"tenant {tenant!r}'s class" if tenant is not None else "an unbound domain's class"
        to = tenant if tenant is not None else "TENANT"
        return Trusted(tenant, allowed, source, text,
                       f"domain {domain!r} asks QoS class {asked_qos}, stronger than it may have: it is {text}, "
                       f"which allows {allowed} ({whose} at most)",
                       f"an operator binds a stronger class: 'vgpuhost tenant bind {domain} {to} --qos {asked_qos}' "
                       f"(at most the tenant's class: 'vgpuhost tenant set {to} --qos ...'), or ask {allowed} or "
                       "weaker; nothing was changed")
    return Trusted(tenant, asked_qos or allowed, source, text)
