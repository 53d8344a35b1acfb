#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: vgpuhost developers
# Apache License 2.0 (see the collection's galaxy.yml)

"""Ansible module: bring a host's NVIDIA GPUs to a vgpuhost layout (plan/apply/assert).

Runs in the target's Python, which must import vgpuhost (set
``ansible_python_interpreter`` to vgpuhost's venv).  It calls
:func:`vgpuhost.layout.plan`, :func:`~vgpuhost.layout.apply` and
:func:`~vgpuhost.layout.check`, the same code path as ``vgpuhost
plan|apply|assert``; it decides nothing itself.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: vgpuhost_layout
short_description: Bring a host's NVIDIA GPUs to a declarative vgpuhost layout
version_added: "0.1.0"
description:
  - Plans and applies a layout from a vgpuhost config file (SR-IOV, MIG mode, GPU instances, mixed-size
    mode, scheduler, vGPUs, passthrough bindings), through vgpuhost's Python API, the code path of
    C(vgpuhost plan), C(vgpuhost apply) and C(vgpuhost assert).
  - In check mode it plans, reports the plan as a diff, and changes nothing; C(changed) says whether the
    plan has steps.
  - Steps that need a reboot (kernel parameters, module options) are reported in C(reboot) and never done.
  - Devices held by running VMs are never touched; such a plan fails before any change and names them.
  - The target's Python must import vgpuhost; set C(ansible_python_interpreter) to vgpuhost's venv.
options:
  config:
    description: Path of the layout config file (vgpuhost config format, version 1) on the target.
    type: path
    required: true
  content:
    description:
      - The config document as text, planned from instead of the file at O(config), which is then only
        named in messages. The role passes it in check mode, so that C(--check) plans the config the run
        would write rather than the one still on disk.
    type: str
    version_added: "0.2.0"
  layout:
    description: Layout name in the config; the config's default when omitted.
    type: str
  root:
    description: Host root; C(/) on a real host, or a simulated host made by C(vgpuhost sim create).
    type: path
    default: /
  state_dir:
    description: vgpuhost's state directory; C(<root>/var/lib/vgpuhost) when omitted.
    type: path
  state:
    description:
      - C(present) applies the layout (plan, then the plan's steps, then a read-back check).
      - C(asserted) only checks, and fails when the host has drifted from the layout.
    type: str
    choices: [present, asserted]
    default: present
requirements:
  - vgpuhost importable by the target's Python
author:
  - vgpuhost developers (!UNKNOWN)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Plans and reports the plan as a diff; nothing on the host changes.
  diff_mode:
    support: full
    details: The plan's steps, or the drift C(asserted) finds, as the diff.
  platform:
    platforms: posix
"""

EXAMPLES = r"""
- name: Apply the default layout
  vgpuhost.vgpuhost.vgpuhost_layout:
    config: /etc/vgpuhost/config.yaml
  vars:
    ansible_python_interpreter: /opt/vgpuhost/bin/python

- name: Fail when a simulated host drifted from layout "training"
  vgpuhost.vgpuhost.vgpuhost_layout:
    config: /srv/sim/etc/vgpuhost/config.yaml
    layout: training
    root: /srv/sim
    state: asserted
"""

RETURN = r"""
layout:
  description: The layout planned.
  returned: success
  type: str
steps:
  description: "The planned steps, in order, as C(target: action (why))."
  returned: success
  type: list
  elements: str
reboot:
  description: Steps that need a reboot; reported, never done.
  returned: success
  type: list
  elements: str
reboot_required:
  description: Whether C(reboot) is not empty.
  returned: success
  type: bool
manual:
  description: Operator steps vgpuhost does not run (SR-IOV); reported.
  returned: when state=present
  type: list
  elements: str
blocked:
  description: Why the layout cannot be applied (devices of running VMs, vGPUs in the way); the task fails.
  returned: when state=present
  type: list
  elements: str
drift:
  description: How the host differed from the layout before this task (C(vgpuhost assert)'s lines).
  returned: success
  type: list
  elements: str
done:
  description: The steps applied.
  returned: when state=present and not in check mode
  type: list
  elements: str
plan:
  description: The plan document (schema C(vgpuhost.plan/v1)).
  returned: success
  type: dict
result:
  description: The apply document, when the layout was applied.
  returned: when state=present and not in check mode
  type: dict
"""

import os
import traceback

from ansible.module_utils.basic import AnsibleModule

try:
    from vgpuhost.model.errors import VgpuhostError
    HAS_VGPUHOST = True
    IMPORT_ERROR = None
except ImportError:  # reported by fail_json in main()
    HAS_VGPUHOST = False
    IMPORT_ERROR = traceback.format_exc()

    class VgpuhostError(Exception):  # placeholder so the except clause below is valid
        pass


def _step_line(step):
    return "%s: %s (%s)" % (step.target, step.action, step.why)


def _prepared(plan):
    """Ansible's diff for a plan: the drift lines, then the printed plan."""
    if plan.diff:
        head = ["drift from layout %r (%s):" % (plan.layout, plan.source)] + list(plan.diff)
    else:
        head = ["in sync with layout %r (%s)" % (plan.layout, plan.source)]
    return "\n".join(head + ["plan:", plan.text()]) + "\n"


def _plan_fields(plan):
    return {
        "layout": plan.layout,
        "steps": [_step_line(s) for s in plan.steps],
        "reboot": [_step_line(s) for s in plan.reboot],
        "manual": [_step_line(s) for s in plan.manual],
        "reboot_required": bool(plan.reboot),
        "blocked": list(plan.blocked),
        "drift": list(plan.diff),
        "plan": plan.as_dict(),
    }


def run(module):
    """Plan / apply / assert; returns the result dict.  Raises VgpuhostError."""
    from vgpuhost.policy import config as vconfig
    from vgpuhost.ops import layout as vlayout
    from vgpuhost.io.hostroot import HostRoot
    from vgpuhost.io.state import StateStore

    p = module.params
    host = HostRoot.from_env(p["root"], p["state_dir"])
    host.require_host()
    if p["content"] is not None:
        cfg = vconfig.parse(p["content"], source=p["config"])
    else:
        cfg = vconfig.load(p["config"])
    cfg.layout(p["layout"])             # an unknown layout name fails before the state store is opened
    read_only = module.check_mode or p["state"] == "asserted"
    store = StateStore(host.state_dir, create=not read_only)

    if p["state"] == "asserted":
        drift = vlayout.check(host, store, cfg, p["layout"])
        out = {"changed": False, "layout": drift.layout, "drift": list(drift.diff), "in_sync": drift.in_sync,
               "reboot": list(drift.reboot)}
        if not drift.in_sync:
            module.fail_json(msg="the host differs from layout %s: %s" % (drift.layout, "; ".join(drift.diff)),
                             **out)
        return out

    if module.check_mode:
        plan = vlayout.plan(host, store, cfg, p["layout"])
        out = _plan_fields(plan)
        out["changed"] = bool(plan.changed)
        if plan.blocked:
            module.fail_json(msg="layout %s cannot be applied: %s" % (plan.layout, "; ".join(plan.blocked)), **out)
    else:
        actor = (os.environ.get("VGPUHOST_ACTOR")
                 or "ansible vgpuhost_layout uid=%d pid=%d" % (os.getuid(), os.getpid()))
        result = vlayout.apply(host, store, cfg, p["layout"], actor=actor)
        plan = result.plan
        out = _plan_fields(plan)
        out["changed"] = bool(result.changed)
        out["done"] = [_step_line(s) for s in result.done]
        out["result"] = result.as_dict()
    for s in plan.reboot:
        module.warn("needs a reboot, not done: " + _step_line(s))
    for s in plan.manual:
        module.warn("operator step, not done: " + _step_line(s))
    if module._diff and out["changed"]:
        out["diff"] = {"prepared": _prepared(plan)}
    return out


def main():
    module = AnsibleModule(
        argument_spec=dict(
            config=dict(type="path", required=True),
            content=dict(type="str"),
            layout=dict(type="str"),
            root=dict(type="path", default="/"),
            state_dir=dict(type="path"),
            state=dict(type="str", choices=["present", "asserted"], default="present"),
        ),
        supports_check_mode=True,
    )
    if not HAS_VGPUHOST:
        import sys
        module.fail_json(msg="vgpuhost is not importable by %s: set ansible_python_interpreter to the Python of "
                             "vgpuhost's venv (e.g. /opt/vgpuhost/bin/python)" % sys.executable,
                         exception=IMPORT_ERROR)
    try:
        module.exit_json(**run(module))
    except VgpuhostError as e:
        module.fail_json(msg=e.one_line(), exit_code=getattr(e, "exit_code", 2))


if __name__ == "__main__":
    main()
