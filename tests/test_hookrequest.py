"""The qemu hook's request policy on plain values (policy/hookrequest.py): no host, no files."""

from __future__ import annotations

import pytest

from vgpuhost.model.errors import InputError
from vgpuhost.model.kinds import Owner
from vgpuhost.model.values import PciAddress
from vgpuhost.policy.hookrequest import MAX_ALLOW_BYTES, holder_text, parse_allow

A = PciAddress.parse


def test_no_file_and_star_allow_every_gpu():
    assert parse_allow(None, "/etc/vgpuhost/hook.allow") is None
    assert parse_allow(b"0000:41:00.0\n*\n", "/etc/vgpuhost/hook.allow") is None


def test_lines_comments_and_blanks():
    data = b"# GPUs guests may use\n\n0000:41:00.0   # the A40\n  0000:81:00.0\n"
    assert parse_allow(data, "f") == frozenset({A("0000:41:00.0"), A("0000:81:00.0")})


def test_a_file_with_no_entry_allows_none():
    assert parse_allow(b"# nothing yet\n", "f") == frozenset()


def test_a_bad_line_names_file_and_line_and_escapes_it():
    with pytest.raises(InputError) as e:
        parse_allow(b"0000:41:00.0\n41:00.0\x1b[2J\n", "/etc/vgpuhost/hook.allow")
    assert e.value.message.startswith("/etc/vgpuhost/hook.allow:2: ")
    assert "\x1b" not in e.value.one_line()


def test_over_the_cap_is_refused():
    with pytest.raises(InputError, match="over"):
        parse_allow(b"#" * (MAX_ALLOW_BYTES + 1), "f")


def test_holder_text_names_pool_owners_and_domains():
    uuid = "11111111-2222-4333-8444-000000000001"
    assert "owner 'manual'" in holder_text(Owner.MANUAL, {})
    assert "owner 'layout'" in holder_text(Owner.LAYOUT, {})
    assert holder_text(uuid, {uuid: "web"}) == f"domain 'web' ({uuid})"
    assert holder_text(uuid, {}) == f"domain {uuid}"
