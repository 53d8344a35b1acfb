/*
 * vgpuhost-hook-client: the qemu hook's thin client to the vgpuhost agent.
 *
 * Two ways to run it:
 *
 *   vgpuhost-hook-client SOCKET ACT NAME ROOT STATE_DIR TIMEOUT_S  < domain.xml
 *
 * (the call alone) reads the domain XML on stdin (at most MAX_XML bytes),
 * connects to the unix socket SOCKET, sends
 *
 *   POST /v1/hook/ACT HTTP/1.1          (ACT: prepare or release)
 *   Content-Type: application/xml
 *   X-Vgpuhost-Domain: NAME
 *   X-Vgpuhost-Root: ROOT
 *   X-Vgpuhost-State-Dir: STATE_DIR
 *   X-Vgpuhost-Timeout: TIMEOUT_S          (the agent starts no work once it has passed)
 *
 * with the XML as the body (the request the dispatcher's curl sends), and
 * reads the answer (at most MAX_ANSWER bytes).  An answer whose body is
 *
 *   vgpuhost-hook/1 EXIT[\nLINE]
 *
 * with EXIT in 0..99 makes it print LINE (when there is one) on stderr and
 * exit with EXIT.  Anything else exits with one of the codes below (100..106)
 * and prints nothing.  The whole call is bounded by TIMEOUT_S seconds.
 *
 *   vgpuhost-hook-client --hook ACT SOCKET TIMEOUT_S DISPATCHER N ARG1..ARGN HANDLER...  < domain.xml
 *
 * (what the sh dispatcher, vgpuhost/hook/qemu.sh, execs, agent or not) does the
 * rest of the dispatcher's work, so no shell reads the XML:
 * the dispatcher's checks on the XML (vgpuhost's namespace, or for 'prepare begin' a host
 * device named; for 'release end' the state store's domain marker; a NUL byte refused), then the call above
 * with NAME = ARG1, ROOT and STATE_DIR from $VGPUHOST_ROOT and
 * $VGPUHOST_STATE_DIR when SOCKET is a socket, then, when the agent did not answer, the fallback
 * the dispatcher makes: exec HANDLER... (the Python handler's command line)
 * with VGPUHOST_AGENT=off and the XML on stdin.  An XML over MAX_XML bytes at 'prepare begin' is
 * decided here without holding more than MAX_XML bytes of it (trial final8 F1: the sh read a 150 MB
 * document whole, 295 MB of memory): when what was read names vgpuhost's namespace or a host device
 * (the sh would hand it to the handler, which refuses it), it is refused at once with the handler's
 * own line and exit 2 (the dispatcher's NUL line where a NUL byte was read), the rest never read;
 * otherwise the rest is scanned in 64 KiB pieces for those names, refused as soon as one shows, and
 * at its end, naming none, nothing to do (exit 0), as the sh decides.  Every other XML over MAX_XML
 * bytes (at 'release end'; a domain name the handler would quote otherwise than 'NAME'; a document
 * whose size past the limit is trailing newlines the sh drops) is handed back whole to DISPATCHER
 * ARG1..ARGN with VGPUHOST_AGENT=off (the sh checks then read it all).
 *
 * In --hook mode a failure of the client itself (100..106 below) ends the hook with one line on stderr
 * and exit 4 (arguments that do not match: reinstall the hook) or 5 (I/O, memory: transient).
 * `vgpuhost-hook-client --version` prints `vgpuhost-hook-client 1` (hook install checks it).
 *
 * No shell, no allocation beyond the fixed maximum sizes, and larger inputs
 * are refused rather than truncated.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

/* exit codes of a call the agent did not answer (the dispatcher falls back) */
#define EX_USAGE_BAD   100   /* wrong arguments, or a value that cannot travel in a header */
#define EX_CONNECT     101   /* no socket, nobody listening, or connect failed */
#define EX_TIMEOUT     102   /* TIMEOUT_S passed */
#define EX_IO          103   /* sending or receiving failed */
#define EX_ANSWER      104   /* the answer is not 'vgpuhost-hook/1 EXIT' (JSON error, garbage, too big) */
#define EX_INPUT       105   /* stdin unreadable, over MAX_XML bytes, or holding a NUL byte */
#define EX_NOMEM       106   /* no memory for the handler's environment */

/* libvirt/domxml.py MAX_XML_BYTES (4 MiB), plus the newline the dispatcher's heredoc adds */
#define MAX_XML (4u * 1024u * 1024u + 1u)
#define MAX_ANSWER (64u * 1024u)
#define MAX_HEADER_VALUE 4096u
#define MAX_TIMEOUT_S (3600L + 5L)   /* hook install --timeout 3600, plus the 5 s the dispatcher adds */
#define ANSWER_TAG "vgpuhost-hook/1 "
#define NAMESPACE "https://vgpuhost.dev/xmlns/domain/1"
#define NUL_LINE "vgpuhost: error: the domain XML on stdin holds a NUL byte (or a control character XML " \
                 "forbids); libvirt never sends one: refused, nothing was changed\n"
#define MAX_PATH 4096u
/* the handler's refusal of a document over libvirt/domxml.py MAX_XML_BYTES, as hook/runtime.py prints it
 * ("vgpuhost: error: domain " + repr(NAME) + ": " + InputError.one_line()); tests/test_hook_client.py
 * compares it with the handler's */
#define OVER_HEAD "vgpuhost: error: domain '"
#define OVER_TAIL "': domain XML is over 4194304 bytes; vgpuhost reads at most 4194304; a libvirt domain " \
                  "document is a few KiB: check what fed this input\n"
/* the longest domain name the client words that refusal for (the handler caps its line at 2000) */
#define MAX_OVER_NAME 1024u
#define SCAN_CHUNK 65536u
/* the bytes a piece keeps from the one before: one less than the longest name looked for */
#define SCAN_KEEP (sizeof NAMESPACE - 2)

static sigjmp_buf deadline;

/* the deadline: back to where the call was armed (sigsetjmp), whatever it was blocked in; the
 * call holds no lock and allocates nothing, so leaving it half-way is safe */
static void on_alarm(int sig)
{
    (void)sig;
    siglongjmp(deadline, 1);
}

/* a header value: at most MAX_HEADER_VALUE bytes, no control character (CR, LF, NUL ...) */
static int header_ok(const char *s)
{
    size_t n = 0;
    for (; s[n] != '\0'; n++) {
        unsigned char c = (unsigned char)s[n];
        if (c < 0x20 || c == 0x7f)
            return 0;
    }
    return n <= MAX_HEADER_VALUE;
}

static int write_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t w = write(fd, buf, len);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        buf += w;
        len -= (size_t)w;
    }
    return 0;
}

/* append text to out[*n] within cap; -1 when it does not fit */
static int put(char *out, size_t *n, size_t cap, const char *text)
{
    size_t len = strlen(text);
    if (len > cap - *n)
        return -1;
    memcpy(out + *n, text, len);
    *n += len;
    return 0;
}

static int put_size(char *out, size_t *n, size_t cap, size_t value)
{
    char digits[24];
    size_t i = sizeof digits;
    digits[--i] = '\0';
    do {
        digits[--i] = (char)('0' + value % 10);
        value /= 10;
    } while (value > 0 && i > 0);
    return put(out, n, cap, digits + i);
}

static int lower_eq(const char *a, const char *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char x = a[i], y = b[i];
        if (x >= 'A' && x <= 'Z')
            x = (char)(x - 'A' + 'a');
        if (y >= 'A' && y <= 'Z')
            y = (char)(y - 'A' + 'a');
        if (x != y)
            return 0;
    }
    return 1;
}

/* The body of an HTTP/1.x answer in ans[0..len): sets *body and *body_len; -1 when malformed or
 * incomplete.  A Content-Length, when present, must fit what was read; chunked answers are refused. */
static int http_body(const char *ans, size_t len, const char **body, size_t *body_len, int complete)
{
    const char *end = NULL;
    for (size_t i = 0; i + 3 < len; i++) {
        if (ans[i] == '\r' && ans[i + 1] == '\n' && ans[i + 2] == '\r' && ans[i + 3] == '\n') {
            end = ans + i;
            break;
        }
    }
    if (end == NULL)
        return complete ? -1 : 1;           /* the head is not all here yet: read on */
    if (len < 12 || memcmp(ans, "HTTP/1.", 7) != 0)
        return -1;
    const char *start = end + 4;
    size_t avail = len - (size_t)(start - ans);
    long content_length = -1;
    const char *line = memchr(ans, '\n', (size_t)(end - ans));
    while (line != NULL && line < end) {
        line++;
        const char *eol = memchr(line, '\r', (size_t)(end - line) + 1);
        if (eol == NULL)
            return -1;
        size_t n = (size_t)(eol - line);
        if (n >= 15 && lower_eq(line, "content-length:", 15)) {
            const char *p = line + 15;
            while (p < eol && (*p == ' ' || *p == '\t'))
                p++;
            if (p == eol)
                return -1;
            long v = 0;
            for (; p < eol; p++) {
                if (*p < '0' || *p > '9' || v > (long)MAX_ANSWER)
                    return -1;
                v = v * 10 + (*p - '0');
            }
            content_length = v;
        } else if (n >= 18 && lower_eq(line, "transfer-encoding:", 18)) {
            return -1;
        }
        line = memchr(line, '\n', (size_t)(end - line) + 1);
        if (line == end + 1)
            break;
    }
    if (content_length >= 0) {
        if ((size_t)content_length > avail)
            return complete ? -1 : 1;       /* 1: read on */
        avail = (size_t)content_length;
    } else if (!complete) {
        return 1;
    }
    *body = start;
    *body_len = avail;
    return 0;
}

/* stdin into buf (cap bytes): 0 when all of it fits, -1 on error, and when there is more (buf full)
 * 1 + the first byte past it (read, so the caller hands it on) */
static int read_input(char *buf, size_t cap, size_t *len)
{
    size_t n = 0;
    for (;;) {
        if (n == cap) {
            char probe;
            ssize_t r = read(STDIN_FILENO, &probe, 1);
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0)
                return -1;
            *len = n;
            if (r == 0)
                return 0;
            return 1 + (unsigned char)probe;
        }
        ssize_t r = read(STDIN_FILENO, buf + n, cap - n);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EBADF && n == 0)
                break;                      /* no stdin at all: an empty document, as the sh's $(tr) reads it */
            return -1;
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    *len = n;
    return 0;
}

/* The call: POST the XML, map the answer.  Returns the agent's EXIT (0..99, its line printed on
 * stderr) or one of the EX_ codes (nothing printed). */
static int agent_call(const char *sock_path, const char *act, const char *name, const char *root,
                      const char *state_dir, const char *xml, size_t xml_len, long timeout_s)
{
    if (strcmp(act, "prepare") != 0 && strcmp(act, "release") != 0)
        return EX_USAGE_BAD;
    if (!header_ok(name) || !header_ok(root) || !header_ok(state_dir))
        return EX_USAGE_BAD;
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    size_t sock_len = strlen(sock_path);
    if (sock_len == 0 || sock_len >= sizeof addr.sun_path)
        return EX_USAGE_BAD;
    memcpy(addr.sun_path, sock_path, sock_len);

    /* the request head: fixed headers plus three values of at most MAX_HEADER_VALUE bytes */
    char head[3 * MAX_HEADER_VALUE + 512];
    size_t hn = 0;
    const size_t hcap = sizeof head;
    if (put(head, &hn, hcap, "POST /v1/hook/") || put(head, &hn, hcap, act)
        || put(head, &hn, hcap, " HTTP/1.1\r\nHost: vgpuhost-agent\r\nUser-Agent: vgpuhost-hook-client/1\r\n"
                                "Accept: */*\r\nConnection: close\r\nContent-Type: application/xml\r\n")
        || put(head, &hn, hcap, "X-Vgpuhost-Domain: ") || put(head, &hn, hcap, name)
        || put(head, &hn, hcap, "\r\nX-Vgpuhost-Root: ") || put(head, &hn, hcap, root)
        || put(head, &hn, hcap, "\r\nX-Vgpuhost-State-Dir: ") || put(head, &hn, hcap, state_dir)
        || put(head, &hn, hcap, "\r\nX-Vgpuhost-Timeout: ") || put_size(head, &hn, hcap, (size_t)timeout_s)
        || put(head, &hn, hcap, "\r\nContent-Length: ") || put_size(head, &hn, hcap, xml_len)
        || put(head, &hn, hcap, "\r\n\r\n"))
        return EX_USAGE_BAD;

    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return EX_CONNECT;
    int rc;
    do {
        rc = connect(fd, (struct sockaddr *)&addr, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + sock_len + 1));
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) {
        close(fd);
        return EX_CONNECT;
    }
    /* a failed send still reads: an agent that refuses early may have answered */
    if (write_all(fd, head, hn) == 0)
        (void)write_all(fd, xml, xml_len);

    static char ans[MAX_ANSWER + 1];
    size_t len = 0;
    const char *body = NULL;
    size_t body_len = 0;
    int parsed = -1;
    for (;;) {
        ssize_t r = read(fd, ans + len, MAX_ANSWER + 1 - len);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            close(fd);
            return EX_IO;
        }
        if (r == 0) {
            parsed = http_body(ans, len, &body, &body_len, 1);
            break;
        }
        len += (size_t)r;
        if (len > MAX_ANSWER) {
            close(fd);
            return EX_ANSWER;
        }
        parsed = http_body(ans, len, &body, &body_len, 0);
        if (parsed <= 0)
            break;          /* complete (Content-Length reached), or malformed */
    }
    close(fd);
    if (parsed != 0)
        return EX_ANSWER;

    /* 'vgpuhost-hook/1 EXIT' [ '\n' LINE ] */
    size_t tag = sizeof ANSWER_TAG - 1;
    if (body_len < tag + 1 || memcmp(body, ANSWER_TAG, tag) != 0)
        return EX_ANSWER;
    size_t i = tag;
    int code = 0, digits = 0;
    while (i < body_len && body[i] >= '0' && body[i] <= '9') {
        code = code * 10 + (body[i] - '0');
        if (++digits > 2)
            return EX_ANSWER;
        i++;
    }
    if (digits == 0 || (i < body_len && body[i] != '\n'))
        return EX_ANSWER;
    if (i < body_len) {
        const char *line = body + i + 1;
        size_t n = body_len - i - 1;
        while (n > 0 && line[n - 1] == '\n')
            n--;
        if (n > 0) {
            /* the line as the agent built it; a failed write to stderr is not worth a fallback */
            alarm(0);
            memmove(ans, line, n);          /* line lies inside ans: to the front, with its newline */
            ans[n] = '\n';
            (void)write_all(STDERR_FILENO, ans, n + 1);
        }
    }
    return code;
}

/* SIGALRM jumps to the deadline (sigsetjmp by the caller, before alarm()); SIGPIPE ignored */
static int catch_alarm(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGALRM, &sa, NULL) != 0)
        return -1;
    signal(SIGPIPE, SIG_IGN);
    return 0;
}

static long parse_timeout(const char *text)
{
    char *stop = NULL;
    errno = 0;
    long t = strtol(text, &stop, 10);
    if (errno != 0 || stop == text || *stop != '\0' || t < 1 || t > MAX_TIMEOUT_S)
        return -1;
    return t;
}

/* ---- --hook: the dispatcher's work from the XML on ---------------------------------------- */

/* the file exists (stat follows symlinks, as sh's test does) with the given type; 0 for any */
static int stat_is(const char *dir, const char *name, mode_t type)
{
    char path[MAX_PATH];
    size_t a = strlen(dir), b = strlen(name);
    if (a + 1 + b + 1 > sizeof path)
        return -1;                          /* cannot tell */
    memcpy(path, dir, a);
    path[a] = '/';
    memcpy(path + a + 1, name, b + 1);
    struct stat st;
    if (stat(path, &st) != 0)
        return 0;
    return type == 0 || (st.st_mode & S_IFMT) == type;
}

/* The text of the XML's one <uuid> element, as the dispatcher's sh patterns find it: 36 characters of
 * 0-9, a-f and '-' (the handler checks the form).  0 (the handler then reads the XML properly) when
 * "<uuid" occurs more than once, or the document holds markup a text scan cannot place: "<!"
 * (comments, CDATA, declarations) or "<?" (processing instructions); libvirt writes none of them. */
static int one_uuid(const char *x, size_t n, char uuid[37])
{
    if (memmem(x, n, "<!", 2) != NULL || memmem(x, n, "<?", 2) != NULL)
        return 0;
    const char *first = memmem(x, n, "<uuid", 5);
    if (first == NULL || memmem(first + 5, n - (size_t)(first + 5 - x), "<uuid", 5) != NULL)
        return 0;
    if ((size_t)(first - x) + 5 >= n || first[5] != '>')
        return 0;
    const char *u = first + 6;
    size_t rest = n - (size_t)(u - x);
    const char *close_tag = memmem(u, rest, "</uuid>", 7);
    size_t ulen = close_tag != NULL ? (size_t)(close_tag - u) : rest;
    if (ulen != 36)
        return 0;
    for (size_t i = 0; i < 36; i++) {
        char c = u[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || c == '-'))
            return 0;
        uuid[i] = c;
    }
    uuid[36] = '\0';
    return 1;
}

/* The dispatcher's sh checks on the XML (x: the XML less its trailing newlines, as $(...) reads it):
 * 1 = nothing to do (exit 0), 0 = go on. */
static int nothing_to_do(const char *act, const char *x, size_t n, const char *state_dir)
{
    if (memmem(x, n, NAMESPACE, sizeof NAMESPACE - 1) != NULL)
        return 0;
    /* prepare: a domain naming a host device ('hostdev', or a character reference that could spell it)
     * is checked too: every GPU device a domain names is admitted or refused */
    if (strcmp(act, "prepare") == 0 && (memmem(x, n, "hostdev", 7) != NULL || memmem(x, n, "&#", 2) != NULL))
        return 0;
    if (strcmp(act, "release") != 0 || state_dir == NULL || stat_is(state_dir, "state.db", S_IFREG) != 1)
        return 1;
    /* the store's marker domains/<uuid>: none for the one <uuid> in the XML, nothing to release */
    if (stat_is(state_dir, "domains", S_IFDIR) != 1)
        return 0;
    char uuid[37];
    if (!one_uuid(x, n, uuid))
        return 0;
    char markers[MAX_PATH];
    size_t sd = strlen(state_dir);
    if (sd + sizeof "/domains" > sizeof markers)
        return 0;
    memcpy(markers, state_dir, sd);
    memcpy(markers + sd, "/domains", sizeof "/domains");
    return stat_is(markers, uuid, 0) == 0;
}

/* 'prepare begin': whether x[0..n) names what makes the sh hand the XML on (vgpuhost's namespace, a host
 * device, or a character reference that could spell one) */
static int names_prepare(const char *x, size_t n)
{
    return memmem(x, n, NAMESPACE, sizeof NAMESPACE - 1) != NULL || memmem(x, n, "hostdev", 7) != NULL
        || memmem(x, n, "&#", 2) != NULL;
}

static int holds_nul(const char *x, size_t n)
{
    return memchr(x, '\0', n) != NULL || memchr(x, '\001', n) != NULL;
}

/* 'prepare begin' with an XML over MAX_XML bytes: xml[0..n] read (n = MAX_XML, xml[n] the byte past it).
 * The exit code, its line printed, decided as the sh and the handler would, holding at most MAX_XML
 * bytes of it; -1: the caller hands it back to the dispatcher (the client cannot word it the same). */
static int over_prepare(const char *xml, size_t n, const char *name)
{
    /* what the sh hands on drops trailing newlines and adds one: over the 4 MiB limit only when a byte
     * other than a newline comes at index MAX_XML - 2 or later */
    if (xml[n - 2] == '\n' && xml[n - 1] == '\n' && xml[n] == '\n')
        return -1;
    size_t len = strlen(name);
    if (len == 0 || len > MAX_OVER_NAME)
        return -1;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)name[i];
        if (c < 0x20 || c >= 0x7f || c == '\'' || c == '\\')
            return -1;              /* Python's repr would not quote it as 'NAME' */
    }
    int nul = holds_nul(xml, n + 1);
    if (!names_prepare(xml, n + 1)) {
        /* the rest, a piece at a time, each after the end of the one before (a name across the seam) */
        static char piece[SCAN_KEEP + SCAN_CHUNK];
        size_t keep = SCAN_KEEP;
        memcpy(piece, xml + n + 1 - keep, keep);
        for (;;) {
            ssize_t r = read(STDIN_FILENO, piece + keep, SCAN_CHUNK);
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0)
                return EX_IO;
            if (r == 0)
                return 0;           /* it names none: nothing to do, as the sh decides */
            nul = nul || holds_nul(piece + keep, (size_t)r);
            size_t have = keep + (size_t)r;
            if (names_prepare(piece, have))
                break;
            memmove(piece, piece + have - SCAN_KEEP, SCAN_KEEP);
            keep = SCAN_KEEP;
        }
    }
    if (nul) {
        (void)write_all(STDERR_FILENO, NUL_LINE, sizeof NUL_LINE - 1);
        return 2;
    }
    if (write_all(STDERR_FILENO, OVER_HEAD, sizeof OVER_HEAD - 1) == 0
        && write_all(STDERR_FILENO, name, len) == 0)
        (void)write_all(STDERR_FILENO, OVER_TAIL, sizeof OVER_TAIL - 1);
    return 2;                       /* input refused, nothing changed (EXIT_INPUT) */
}

/* stdin becomes a pipe holding data[0..len), then whatever is left on the old stdin when rest is
 * set; a writer child (stdout and stderr on /dev/null) feeds what does not fit in the pipe. 0 or -1. */
static int refeed_stdin(const char *data, size_t len, int rest)
{
    int p[2];
    if (pipe(p) != 0)
        return -1;
    int room = fcntl(p[1], F_GETPIPE_SZ);
    if (!rest && room > 0 && len <= (size_t)room) {
        if (write_all(p[1], data, len) != 0)
            return -1;
    } else {
        pid_t pid = fork();
        if (pid < 0)
            return -1;
        if (pid == 0) {
            close(p[0]);
            int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
            if (devnull >= 0) {
                dup2(devnull, STDOUT_FILENO);
                dup2(devnull, STDERR_FILENO);
            }
            alarm(0);
            if (write_all(p[1], data, len) != 0)
                _exit(1);
            if (rest) {
                static char chunk[65536];
                for (;;) {
                    ssize_t r = read(STDIN_FILENO, chunk, sizeof chunk);
                    if (r < 0 && errno == EINTR)
                        continue;
                    if (r <= 0 || write_all(p[1], chunk, (size_t)r) != 0)
                        break;
                }
            }
            _exit(0);
        }
    }
    close(p[1]);
    if (dup2(p[0], STDIN_FILENO) < 0)
        return -1;
    close(p[0]);
    return 0;
}

static int run_instead(char **argv)
{
    alarm(0);
    signal(SIGPIPE, SIG_DFL);
    if (setenv("VGPUHOST_AGENT", "off", 1) != 0)
        return EX_NOMEM;
    execv(argv[0], argv);
    int e = errno;
    const char *what = strerror(e);
    (void)write_all(STDERR_FILENO, "vgpuhost-hook-client: cannot run ", 33);
    (void)write_all(STDERR_FILENO, argv[0], strlen(argv[0]));
    (void)write_all(STDERR_FILENO, ": ", 2);
    (void)write_all(STDERR_FILENO, what, strlen(what));
    (void)write_all(STDERR_FILENO, "\n", 1);
    return e == ENOENT ? 127 : 126;
}

static int hook_mode(int argc, char **argv)
{
    /* --hook ACT SOCKET TIMEOUT_S DISPATCHER N ARG1..ARGN HANDLER... */
    if (argc < 8)
        return EX_USAGE_BAD;
    const char *act = argv[2], *sock_path = argv[3], *dispatcher = argv[5];
    long timeout_s = parse_timeout(argv[4]);
    char *stop = NULL;
    long nargs = strtol(argv[6], &stop, 10);
    if (timeout_s < 0 || stop == argv[6] || *stop != '\0' || nargs < 1 || nargs > argc - 8)
        return EX_USAGE_BAD;
    char **args = argv + 7;                 /* ARG1..ARGN: libvirt's */
    char **handler = args + nargs;          /* at least one word */
    const char *name = args[0];
    const char *root = getenv("VGPUHOST_ROOT"), *state_dir = getenv("VGPUHOST_STATE_DIR");
    if (catch_alarm() != 0)
        return EX_IO;

    /* read as the dispatcher's sh reads it: with no deadline (libvirt writes it at once) */
    static char xml[MAX_XML + 1];           /* the XML plus the newline the handler gets after it */
    size_t n = 0;
    int over = read_input(xml, MAX_XML, &n);
    if (over < 0)
        return run_instead(handler);        /* unreadable: the handler says so */
    if (over > 0 && strcmp(act, "prepare") == 0) {
        /* too large for the agent and the handler: refused, or nothing to do, as the sh would decide */
        xml[n] = (char)(over - 1);          /* the probe byte read past the limit */
        int code = over_prepare(xml, n, name);
        if (code >= 0)
            return code;
    }
    if (over > 0) {
        /* the sh dispatcher reads it all, the handler refuses or not */
        char *again[nargs + 2];
        again[0] = (char *)dispatcher;
        for (long i = 0; i < nargs; i++)
            again[i + 1] = args[i];
        again[nargs + 1] = NULL;
        xml[n] = (char)(over - 1);          /* the probe byte read past the limit */
        if (refeed_stdin(xml, n + 1, 1) != 0)
            return EX_IO;
        return run_instead(again);
    }
    size_t x = n;                           /* as $(...) reads it: trailing newlines dropped */
    while (x > 0 && xml[x - 1] == '\n')
        x--;
    if (nothing_to_do(act, xml, x, state_dir))
        return 0;
    if (memchr(xml, '\0', x) != NULL || memchr(xml, '\001', x) != NULL) {
        (void)write_all(STDERR_FILENO, NUL_LINE, sizeof NUL_LINE - 1);
        return 2;
    }
    xml[x] = '\n';                          /* the document as the dispatcher hands it on */
    int printable = 1;
    for (const char *c = name; *c; c++)
        if ((unsigned char)*c < 0x20 || (unsigned char)*c >= 0x7f)
            printable = 0;
    struct stat sock_st;                    /* no socket: the agent is not running, the handler does the work */
    int agent_up = stat(sock_path, &sock_st) == 0 && S_ISSOCK(sock_st.st_mode);
    if (agent_up && printable && root != NULL && state_dir != NULL) {
        if (sigsetjmp(deadline, 1) == 0) {
            alarm((unsigned)timeout_s);
            int code = agent_call(sock_path, act, name, root, state_dir, xml, x + 1, timeout_s);
            alarm(0);
            if (code < 100)
                return code;
        }
        /* timed out (the jump), or not answered: the handler does the work itself */
    }
    if (refeed_stdin(xml, x + 1, 0) != 0)
        return EX_IO;
    return run_instead(handler);
}

/* --hook: the client's own failure before the handler could take over ends the hook with one line
 * (libvirt shows it) and an exit code of vgpuhost's table, never a bare 100..106 */
static int hook_failed(int code)
{
    static const char head[] = "vgpuhost: error: the hook's client (vgpuhost-hook-client) failed before the domain's "
                               "devices were touched: ";
    const char *what, *hint;
    int exit_code;
    if (code == EX_USAGE_BAD) {
        what = "the dispatcher and the client do not agree on their arguments";
        hint = "; run 'vgpuhost hook install' again with this vgpuhost's client";
        exit_code = 4;
    } else {
        what = code == EX_NOMEM ? "out of memory" : "an I/O error";
        hint = "; nothing was changed, starting the domain again may succeed";
        exit_code = 5;
    }
    (void)write_all(STDERR_FILENO, head, sizeof head - 1);
    (void)write_all(STDERR_FILENO, what, strlen(what));
    (void)write_all(STDERR_FILENO, hint, strlen(hint));
    (void)write_all(STDERR_FILENO, "\n", 1);
    return exit_code;
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--version") == 0) {
        static const char v[] = "vgpuhost-hook-client 1\n";   /* hook install checks this answer */
        return write_all(STDOUT_FILENO, v, sizeof v - 1) == 0 ? 0 : EX_IO;
    }
    if (argc >= 2 && strcmp(argv[1], "--hook") == 0) {
        int code = hook_mode(argc, argv);
        return code >= EX_USAGE_BAD && code <= EX_NOMEM ? hook_failed(code) : code;
    }
    if (argc != 7)
        return EX_USAGE_BAD;
    long timeout_s = parse_timeout(argv[6]);
    if (timeout_s < 0)
        return EX_USAGE_BAD;
    if (catch_alarm() != 0)
        return EX_IO;
    if (sigsetjmp(deadline, 1) != 0)
        return EX_TIMEOUT;
    alarm((unsigned)timeout_s);
    /* the XML: stdin, read whole; one byte over MAX_XML refuses it */
    static char xml[MAX_XML];
    size_t xml_len = 0;
    if (read_input(xml, MAX_XML, &xml_len) != 0)
        return EX_INPUT;
    if (memchr(xml, '\0', xml_len) != NULL)
        return EX_INPUT;
    return agent_call(argv[1], argv[2], argv[3], argv[4], argv[5], xml, xml_len, timeout_s);
}
