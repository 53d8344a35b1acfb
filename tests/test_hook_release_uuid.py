"""``release end`` without parsing the XML (issue 17 #3), and only ever for the domain libvirt names.

The handler (and the agent, which decides the same way) takes the UUID of a
whole document's one ``<uuid>`` element, in a document without comments,
CDATA, declarations or processing instructions, when the store recorded that
UUID as started under the name libvirt gives the hook; otherwise it parses the
XML.  Asserted: the vGPU goes and domxml is not imported; documents crafted to
show another domain's UUID never release that domain, through the client and
through the sh alone; a cut document is refused, and a whole but malformed
one released, the same with the agent up and down; a stop without stdin acts
on an empty document.
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


def test_release_of_a_whole_document_parses_no_xml(make_host):
    host = _two_domains(make_host)
    proc = _handler(host, vgpu_domain("a", DOM1, MDEV1), {"VGPUHOST_AGENT": "off"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().split() == ["0", "False", "False"]
    assert _owners(host) == {DOM2}
    assert not (host.mdev_devices / MDEV1).exists() and (host.mdev_devices / MDEV2).exists()


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


@pytest.mark.parametrize("client", ["compiled", "none"])
def test_a_document_with_two_uuid_elements_is_read_by_the_handler(make_host, tmp_path, client):
    """Another namespace's ``<uuid>`` in the metadata (``b``'s UUID): no shortcut, and the handler's
    parser finds the domain's own."""
    host = _two_domains(make_host)
    hook = install(host, tmp_path, **({} if client == "compiled" else {"client": "none"}))
    meta = Metadata(vgpus=[VgpuRequest("A40-8Q", uuid=MDEV1)]).to_xml()
    foreign = f"<other:info xmlns:other='urn:example'><uuid>{DOM2}</uuid></other:info>\n"
    xml = domain_xml("a", DOM1, raw_meta=foreign + meta, hostdevs=[mdev_hostdev(MDEV1)])
    assert xml.count("<uuid>") == 2
    proc = subprocess.run([str(hook), "a", "release", "end", "-"], input=xml.encode(), capture_output=True,
                          env=LIBVIRT_ENV, timeout=120)
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


def test_a_uuid_the_store_records_under_another_name_is_not_taken(make_host):
    """``released_domain`` takes a UUID only where the store started it under libvirt's name for the domain."""
    from vgpuhost.hook.runtime import released_domain
    host = _two_domains(make_host)
    a_doc, b_doc = vgpu_domain("a", DOM1, MDEV1).encode(), vgpu_domain("b", DOM2, MDEV2).encode()
    st = store(host)
    assert released_domain(a_doc, "a", st).uuid == DOM1
    assert released_domain(b_doc, "a", st) is None            # b's UUID, stopping a: parse instead
    assert released_domain(a_doc, "", st) is None
    assert released_domain(a_doc.replace(b"</domain>", b"</domain>\n<!-- x -->"), "a", st) is None


@pytest.mark.parametrize("spoil", ["mismatched-tag", "undefined-entity", "second-root"])
def test_a_whole_but_malformed_document_is_released_the_same_with_the_agent_up_or_down(make_host, tmp_path,
                                                                                      spoil):
    """The second breaker's finding: a document that ends with ``</domain>`` but is not well-formed was
    released without the agent and refused with it.  Both decide with ``released_domain`` now: released."""
    from agentutil import AgentRun
    doc = vgpu_domain("a", DOM1, MDEV1)
    doc = {"mismatched-tag": doc.replace("</os>", "</oss>"),
           "undefined-entity": doc.replace("<memory", "<description>&bogus;</description><memory"),
           "second-root": doc + "<domain></domain>\n"}[spoil]
    for agent_up in (False, True):
        host = _two_domains(make_host)
        hook = install(host, tmp_path / str(agent_up))
        if agent_up:
            with AgentRun(host.root, str(host.path("run", "vgpuhost"))):
                proc = subprocess.run([str(hook), "a", "release", "end", "-"], input=doc.encode(),
                                      capture_output=True, env=LIBVIRT_ENV, timeout=120)
        else:
            proc = subprocess.run([str(hook), "a", "release", "end", "-"], input=doc.encode(), capture_output=True,
                                  env=LIBVIRT_ENV, timeout=120)
        assert (proc.returncode, proc.stderr) == (0, b""), (agent_up, proc.stderr)
        assert _owners(host) == {DOM2}, agent_up

