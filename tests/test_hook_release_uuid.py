"""``release end`` from the dispatcher's UUID (issue 17 #3): the handler parses no XML, and only ever
this XML's UUID is taken.

The dispatcher (sh) and its compiled client read the domain's one ``<uuid>``
element and hand it to the handler as ``VGPUHOST_DOMAIN_UUID``; the handler,
after the agent was tried (``VGPUHOST_AGENT=off``), releases that domain
without importing the XML parser.  Asserted: the vGPU goes and domxml is not
imported; a value left in the hook's environment for another domain is never
used (the other domain keeps its vGPU), through the client and through the sh
alone; a document with two ``<uuid>`` elements, a malformed value, or an agent
not tried yet make the handler read the XML itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vgpuhost.io.files import package_parent

from test_hook import (DOM1, DOM2, MDEV1, MDEV2, domain_xml, install, mdev_hostdev, start, store,
                       vgpu_domain)
from vgpuhost.libvirt.domxml import Metadata, VgpuRequest

LIBVIRT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
               "LC_ALL": "C"}


def _two_domains(make_host):
    host = make_host("a40-mdev")
    for name, dom, mdev in (("a", DOM1, MDEV1), ("b", DOM2, MDEV2)):
        assert start(host, name, vgpu_domain(name, dom, mdev)) == (0, "")
    assert {r.owner for r in store(host).vgpu_records()} == {DOM1, DOM2}
    return host


def _handler(host, xml: str, env: dict, name: str = "a") -> subprocess.CompletedProcess:
    """``release end`` in a fresh ``python -I -S``, as the dispatcher starts the handler; prints whether
    the XML parser was imported."""
    code = textwrap.dedent(f"""\
        import sys
        sys.path[:0] = [{package_parent()!r}]
        from vgpuhost.hook import runtime
        rc = runtime.main([{name!r}, 'release', 'end', '-'], sys.stdin.buffer)
        print(rc, 'vgpuhost.libvirt.domxml' in sys.modules, 'pyexpat' in sys.modules)
        """)
    return subprocess.run([sys.executable, "-I", "-S", "-c", code], input=xml.encode(), capture_output=True,
                          env=dict(LIBVIRT_ENV, VGPUHOST_ROOT=str(host.root), **env), timeout=120)


def _owners(host):
    return {r.owner for r in store(host).vgpu_records()}


def test_release_from_the_dispatchers_uuid_parses_no_xml(make_host):
    host = _two_domains(make_host)
    proc = _handler(host, vgpu_domain("a", DOM1, MDEV1), {"VGPUHOST_DOMAIN_UUID": DOM1, "VGPUHOST_AGENT": "off"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().split() == ["0", "False", "False"]
    assert _owners(host) == {DOM2}
    assert not (host.mdev_devices / MDEV1).exists() and (host.mdev_devices / MDEV2).exists()


def test_a_uuid_the_store_records_under_another_name_is_not_taken(make_host):
    """Stopping ``a`` with ``b``'s UUID handed in (a crafted document, or a caller's environment): the store
    recorded that UUID as ``b``, not as libvirt's ``a``, so the handler reads the XML and releases ``a``."""
    host = _two_domains(make_host)
    proc = _handler(host, vgpu_domain("a", DOM1, MDEV1), {"VGPUHOST_DOMAIN_UUID": DOM2, "VGPUHOST_AGENT": "off"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().split() == ["0", "True", "True"]
    assert _owners(host) == {DOM2}
    assert (host.mdev_devices / MDEV2).exists() and not (host.mdev_devices / MDEV1).exists()


@pytest.mark.parametrize("xml_of", ["comment", "cdata", "foreign-element", "processing-instruction"])
@pytest.mark.parametrize("client", ["compiled", "none"])
def test_a_uuid_outside_the_domains_own_element_never_names_a_domain(make_host, tmp_path, client, xml_of):
    """The breaker's documents: ``b``'s UUID as the only ``<uuid>`` text (in a comment, CDATA, a foreign
    element or a processing instruction) and ``a``'s own written ``<uuid >``: stopping ``a`` releases ``a``."""
    host = _two_domains(make_host)
    hook = install(host, tmp_path, **({} if client == "compiled" else {"client": "none"}))
    wrap = {"comment": "<!-- <uuid>{}</uuid> -->", "cdata": "<![CDATA[<uuid>{}</uuid>]]>",
            "foreign-element": "<x:i xmlns:x='urn:x' xmlns='urn:y'><uuid>{}</uuid></x:i>",
            "processing-instruction": "<?note <uuid>{}</uuid>?>"}[xml_of].format(DOM2)
    xml = vgpu_domain("a", DOM1, MDEV1).replace(f"<uuid>{DOM1}</uuid>", f"{wrap}<uuid >{DOM1}</uuid >")
    assert xml.count("<uuid>") == 1
    proc = subprocess.run([str(hook), "a", "release", "end", "-"], input=xml.encode(), capture_output=True,
                          env=LIBVIRT_ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _owners(host) == {DOM2}
    assert (host.mdev_devices / MDEV2).exists() and not (host.mdev_devices / MDEV1).exists()


@pytest.mark.parametrize("env", [{"VGPUHOST_DOMAIN_UUID": "not-a-uuid", "VGPUHOST_AGENT": "off"},
                                 {"VGPUHOST_DOMAIN_UUID": "", "VGPUHOST_AGENT": "off"},
                                 {"VGPUHOST_DOMAIN_UUID": DOM1}],          # the agent not tried yet
                         ids=["malformed", "empty", "agent-not-tried"])
def test_without_a_usable_uuid_the_handler_reads_the_xml(make_host, env):
    host = _two_domains(make_host)
    proc = _handler(host, vgpu_domain("a", DOM1, MDEV1), dict(env, VGPUHOST_AGENT_SOCKET="/nonexistent/sock"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().split() == ["0", "True", "True"]
    assert _owners(host) == {DOM2}


@pytest.mark.parametrize("client", ["compiled", "none"])
def test_a_uuid_left_in_the_environment_is_never_taken_for_this_domains(make_host, tmp_path, client):
    """libvirt's environment carrying another domain's UUID: the dispatcher sets its own (the client, or
    the sh alone with curl and no agent), so stopping ``a`` releases ``a``'s vGPU, never ``b``'s."""
    host = _two_domains(make_host)
    hook = install(host, tmp_path, **({} if client == "compiled" else {"client": "none"}))
    if client == "compiled":
        assert "vgpuhost-hook-client" in hook.read_text()
    env = dict(LIBVIRT_ENV, VGPUHOST_DOMAIN_UUID=DOM2)
    proc = subprocess.run([str(hook), "a", "release", "end", "-"], input=vgpu_domain("a", DOM1, MDEV1).encode(),
                          capture_output=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _owners(host) == {DOM2}
    assert (host.mdev_devices / MDEV2).exists() and not (host.mdev_devices / MDEV1).exists()


@pytest.mark.parametrize("client", ["compiled", "none"])
def test_a_document_with_two_uuid_elements_is_read_by_the_handler(make_host, tmp_path, client):
    """Another namespace's ``<uuid>`` in the metadata (``b``'s UUID), and ``b``'s UUID left in the
    environment too: the dispatcher hands no UUID on (it clears that one), and the handler's parser
    finds the domain's own."""
    host = _two_domains(make_host)
    hook = install(host, tmp_path, **({} if client == "compiled" else {"client": "none"}))
    meta = Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=MDEV1)]).to_xml()
    foreign = f"<other:info xmlns:other='urn:example'><uuid>{DOM2}</uuid></other:info>\n"
    xml = domain_xml("a", DOM1, raw_meta=foreign + meta, hostdevs=[mdev_hostdev(MDEV1)])
    assert xml.count("<uuid>") == 2
    proc = subprocess.run([str(hook), "a", "release", "end", "-"], input=xml.encode(), capture_output=True,
                          env=dict(LIBVIRT_ENV, VGPUHOST_DOMAIN_UUID=DOM2), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _owners(host) == {DOM2}
    assert os.path.exists(host.mdev_devices / MDEV2)


@pytest.mark.parametrize("client", ["compiled", "none"])
def test_a_uuid_in_a_comment_does_not_skip_the_release_of_a_domain_without_metadata(make_host, tmp_path, client):
    """A domain whose vgpuhost metadata is gone by its stop (the store says what it holds), and a comment
    naming a UUID the store never started before its own ``<uuid >``: the dispatcher does not take the
    comment's for the domain's (no marker, nothing to release) but hands the document to the handler."""
    host = _two_domains(make_host)
    hook = install(host, tmp_path, **({} if client == "compiled" else {"client": "none"}))
    stranger = "99999999-2222-4333-8444-000000000009"
    xml = domain_xml("a", DOM1).replace(f"<uuid>{DOM1}</uuid>", f"<!-- <uuid>{stranger}</uuid> --><uuid >{DOM1}</uuid >")
    assert "vgpuhost.dev" not in xml and xml.count("<uuid>") == 1
    proc = subprocess.run([str(hook), "a", "release", "end", "-"], input=xml.encode(), capture_output=True,
                          env=LIBVIRT_ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _owners(host) == {DOM2}
    assert not (host.mdev_devices / MDEV1).exists()



def test_the_read_limit_is_the_parsers():
    from vgpuhost.hook.runtime import READ_LIMIT
    from vgpuhost.libvirt.domxml import MAX_XML_BYTES
    assert READ_LIMIT == MAX_XML_BYTES + 1


@pytest.mark.parametrize("client", ["compiled", "none"])
def test_a_cut_document_is_refused_as_the_agent_refuses_it(make_host, tmp_path, client):
    """The breaker's finding: the first 400 bytes of ``a``'s document (its name and UUID in them) were
    released without the agent and refused with it; now refused both ways, nothing released."""
    host = _two_domains(make_host)
    hook = install(host, tmp_path, **({} if client == "compiled" else {"client": "none"}))
    cut = vgpu_domain("a", DOM1, MDEV1)[:400]
    assert f"<uuid>{DOM1}</uuid>" in cut and not cut.rstrip().endswith("</domain>")
    proc = subprocess.run([str(hook), "a", "release", "end", "-"], input=cut.encode(), capture_output=True,
                          env=LIBVIRT_ENV, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "not well-formed" in proc.stderr.decode() or "XML" in proc.stderr.decode(), proc.stderr
    assert _owners(host) == {DOM1, DOM2}


@pytest.mark.parametrize("client", ["compiled", "none"])
def test_a_hook_started_without_stdin_acts_as_on_an_empty_document(make_host, tmp_path, client):
    """The breaker's finding: ``prepare begin`` with stdin closed gave a traceback through the client; both
    ways it is now an empty document: nothing of vgpuhost's in it, nothing to do, exit 0."""
    host = _two_domains(make_host)
    hook = install(host, tmp_path, **({} if client == "compiled" else {"client": "none"}))
    proc = subprocess.run([str(hook), "c", "prepare", "begin", "-"], stdin=subprocess.DEVNULL, capture_output=True,
                          env=LIBVIRT_ENV, timeout=120, preexec_fn=lambda: os.close(0))
    assert proc.returncode == 0, proc.stderr
    if client == "compiled":
        assert proc.stderr == b""           # (the sh's tr says its read failed)
    assert _owners(host) == {DOM1, DOM2}
