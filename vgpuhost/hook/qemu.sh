#!/bin/sh
@MARKER@ (vgpuhost @VERSION@)
# Do not edit: change the install options and run 'vgpuhost hook install' again.
#
# libvirt's qemu hook for vgpuhost: libvirt (>= 6.5) runs every executable in
# /etc/libvirt/hooks/qemu.d/ as  HOOK <domain> <operation> <sub-operation> <extra>
# with the domain XML on stdin (docs/reference/libvirt.md).  This POSIX sh dispatcher
# decides before any Python starts: only 'prepare begin', 'release end' and
# 'migrate begin' act ('migrate begin' always in the handler); 'prepare begin' only for a domain whose XML names vgpuhost's metadata
# namespace or a host device, 'release end' also for a domain the state store records as
# started (its marker file: the store, not the XML, says what a domain holds,
# and its metadata may be gone or changed by then); everything else exits 0
# at once.
#
# When the vgpuhost agent's admin socket answers, a thin client hands it the
# XML (POST /v1/hook/prepare|release, Content-Type application/xml) and no
# Python starts: the agent answers 'vgpuhost-hook/1 EXIT' and the one line
# to print, and the hook exits with EXIT.  The compiled client
# (vgpuhost-hook-client, from vgpuhost/hook/client.c) is exec'd before this
# script reads the XML, agent or not, and makes the checks below itself, so
# no shell or tr reads it; without it, curl is run from here.  Any other outcome (no
# socket, the client failing, an agent that may not or cannot take the call)
# falls back to the handler (vgpuhost.hook), which then does the work
# itself.  The handler gets the XML on stdin.  exec: no child is left
# holding libvirt's stdout/stderr.
case "$2 $3" in
'prepare begin') act=prepare ;;
'release end') act=release ;;
'migrate begin') act=migrate ;;
*) exit 0 ;;
esac
VGPUHOST_ROOT=@ROOT@
VGPUHOST_STATE_DIR=@STATE_DIR@
# migrate begin (the destination of a live migration): the handler itself, never the agent, reads the
# incoming XML on stdin and prints the rewritten one on stdout (empty: unchanged), as libvirt's hook
# contract allows (docs/guide/migration.md)
if [ "$act" = migrate ]; then
	VGPUHOST_HOOK_TIMEOUT=@TIMEOUT_S@
	VGPUHOST_AGENT=off
	export VGPUHOST_ROOT VGPUHOST_STATE_DIR VGPUHOST_HOOK_TIMEOUT VGPUHOST_AGENT
	exec @PYTHON@ -I -S -c @BOOT@ "$@"
fi
# The compiled client takes over from here whether or not the agent runs (no
# socket: it does not try the agent, and execs the handler itself): a fork of
# tr, one of a subshell and a here-document less than the lines below (0.3 ms
# a call, measured 2026-12-01).  VGPUHOST_AGENT=off skips it: the client sets
# that before it execs the handler, or this script again for an XML over 4 MiB
# it leaves to the sh (one at 'prepare begin' it refuses or lets through itself,
# holding at most 4 MiB of it: vgpuhost/hook/client.c).
case ${VGPUHOST_AGENT-} in
[Oo][Ff][Ff]|0|[Nn][Oo]) ;;
*)
	sock=${VGPUHOST_AGENT_SOCKET:-@AGENT_SOCKET@}
	for c in @CLIENTS@; do
		if [ -x "$c" ]; then
			VGPUHOST_HOOK_TIMEOUT=@TIMEOUT_S@
			export VGPUHOST_ROOT VGPUHOST_STATE_DIR VGPUHOST_HOOK_TIMEOUT
			exec "$c" --hook "$act" "$sock" $((VGPUHOST_HOOK_TIMEOUT + 5)) "$0" $# "$@" \
				@PYTHON@ -I -S -c @BOOT@ "$@"
		fi
	done ;;
esac
# A shell variable cannot hold a NUL byte ($(cat) drops it silently), so NUL
# becomes \001 here, which XML forbids too, and such a document is refused.
xml=$(tr '\000' '\001')
# release end: the domain's UUID, the XML's one <uuid> element, for the marker
# check below; empty (the handler reads the XML properly) when "<uuid" occurs
# more than once or the document has markup a text scan cannot place
# (comments, CDATA, declarations, processing instructions: libvirt writes none)
uuid=
if [ "$act" = release ]; then
	case $xml in
	*'<!'*|*'<?'*|*'<uuid'*'<uuid'*) ;;
	*'<uuid>'*)
		u=${xml#*'<uuid>'}
		u=${u%%'</uuid>'*}
		case $u in
		*[!0-9a-f-]*) ;;
		*) [ ${#u} -eq 36 ] && uuid=$u ;;
		esac ;;
	esac
fi
# prepare begin also for a domain that names a host device ('hostdev': <hostdev>, <interface
# type='hostdev'>; '&#': a character reference could spell that type): every GPU device a domain
# names is admitted or refused, declared in vgpuhost's metadata or not
case $act:$xml in
*'https://vgpuhost.dev/xmlns/domain/1'*|prepare:*hostdev*|prepare:*'&#'*) ;;
*)
	[ "$act" = release ] && [ -f "$VGPUHOST_STATE_DIR/state.db" ] || exit 0
	# the store keeps a marker domains/<uuid> for each domain it records as
	# started: none for this domain's UUID, nothing to release, no Python
	if [ -d "$VGPUHOST_STATE_DIR/domains" ] && [ -n "$uuid" ] &&
	   [ ! -e "$VGPUHOST_STATE_DIR/domains/$uuid" ]; then
		exit 0
	fi ;;
esac
case $xml in
*"$(printf '\001')"*)
  echo "vgpuhost: error: the domain XML on stdin holds a NUL byte (or a control character XML forbids); libvirt never sends one: refused, nothing was changed" >&2
  exit 2 ;;
esac
VGPUHOST_HOOK_TIMEOUT=@TIMEOUT_S@
export VGPUHOST_ROOT VGPUHOST_STATE_DIR VGPUHOST_HOOK_TIMEOUT
curl=
case ${VGPUHOST_AGENT-} in
[Oo][Ff][Ff]|0|[Nn][Oo]) ;;
*)
	for d in @CURL_DIRS@; do
		if [ -x "$d/curl" ]; then curl=$d/curl; break; fi
	done ;;
esac
if [ -n "$curl" ]; then
	sock=${VGPUHOST_AGENT_SOCKET:-@AGENT_SOCKET@}
	nl='
'
	case $1 in
	*[![:print:]]*) sock= ;;    # a name that cannot travel in a header: the handler does it
	esac
	if [ -n "$sock" ] && [ -S "$sock" ] && ans=$("$curl" -s --max-time $((VGPUHOST_HOOK_TIMEOUT + 5)) \
		--unix-socket "$sock" -H 'Content-Type: application/xml' -H 'Expect:' -H "X-Vgpuhost-Domain: $1" \
		-H "X-Vgpuhost-Root: $VGPUHOST_ROOT" -H "X-Vgpuhost-State-Dir: $VGPUHOST_STATE_DIR" \
		-H "X-Vgpuhost-Timeout: $((VGPUHOST_HOOK_TIMEOUT + 5))" \
		--data-binary @- "http://vgpuhost-agent/v1/hook/$act" <<VGPUHOST_XML_END
$xml
VGPUHOST_XML_END
	); then
		case $ans in
		'vgpuhost-hook/1 '*)
			code=${ans%%"$nl"*}
			code=${code#'vgpuhost-hook/1 '}
			line=${ans#*"$nl"}
			case $code in
			''|*[!0-9]*) ;;
			*)
				[ "$line" = "$ans" ] || [ -z "$line" ] || printf '%s\n' "$line" >&2
				exit "$code" ;;
			esac ;;
		esac
	fi
	VGPUHOST_AGENT=off          # tried above: the handler does the work itself
	export VGPUHOST_AGENT
fi
exec @PYTHON@ -I -S -c @BOOT@ "$@" <<VGPUHOST_XML_END
$xml
VGPUHOST_XML_END
