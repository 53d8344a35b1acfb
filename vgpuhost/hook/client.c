/*
 * vgpuhost-hook-client: the qemu hook's thin client to the vgpuhost agent.
 *
 *   vgpuhost-hook-client SOCKET ACT NAME ROOT STATE_DIR TIMEOUT_S  < domain.xml
 *
 * The sh dispatcher (vgpuhost/hooks/qemu) runs it when the agent's admin
 * socket exists.  It reads the domain XML on stdin (at most MAX_XML bytes),
 * connects to the unix socket SOCKET, sends
 *
 *   POST /v1/hook/ACT HTTP/1.1          (ACT: prepare or release)
 *   Content-Type: application/xml
 *   X-Vgpuhost-Domain: NAME
 *   X-Vgpuhost-Root: ROOT
 *   X-Vgpuhost-State-Dir: STATE_DIR
 *
 * with the XML as the body (the request curl sends), and reads the answer
 * (at most MAX_ANSWER bytes).  An answer whose body is
 *
 *   vgpuhost-hook/1 EXIT[\nLINE]
 *
 * with EXIT in 0..99 makes it print LINE (when there is one) on stderr and
 * exit with EXIT.  Anything else exits with one of the codes below (100..107),
 * prints nothing, and the dispatcher falls back to the Python handler, which
 * does the work itself.  The whole call is bounded by TIMEOUT_S seconds
 * (alarm).  No shell, no allocation beyond the fixed maximum sizes, and
 * larger inputs are refused rather than truncated.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

/* exit codes of a call the agent did not answer (the dispatcher falls back) */
#define EX_USAGE_BAD   100   /* wrong arguments, or a value that cannot travel in a header */
#define EX_CONNECT     101   /* no socket, nobody listening, or connect failed */
#define EX_TIMEOUT     102   /* TIMEOUT_S passed */
#define EX_IO          103   /* sending or receiving failed */
#define EX_ANSWER      104   /* the answer is not 'vgpuhost-hook/1 EXIT' (JSON error, garbage, too big) */
#define EX_INPUT       105   /* stdin unreadable, over MAX_XML bytes, or holding a NUL byte */
#define EX_NOMEM       106   /* the XML buffer could not be had */

/* libvirt/domxml.py MAX_XML_BYTES (4 MiB), plus the newline the dispatcher's heredoc adds */
#define MAX_XML (4u * 1024u * 1024u + 1u)
#define MAX_ANSWER (64u * 1024u)
#define MAX_HEADER_VALUE 4096u
#define MAX_TIMEOUT_S 3600L
#define ANSWER_TAG "vgpuhost-hook/1 "

static void on_alarm(int sig)
{
    (void)sig;
    _exit(EX_TIMEOUT);
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
    if (end == NULL || len < 12 || memcmp(ans, "HTTP/1.", 7) != 0)
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

int main(int argc, char **argv)
{
    if (argc != 7)
        return EX_USAGE_BAD;
    const char *sock_path = argv[1], *act = argv[2], *name = argv[3], *root = argv[4], *state_dir = argv[5];
    char *stop = NULL;
    errno = 0;
    long timeout_s = strtol(argv[6], &stop, 10);
    if (errno != 0 || stop == argv[6] || *stop != '\0' || timeout_s < 1 || timeout_s > MAX_TIMEOUT_S)
        return EX_USAGE_BAD;
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

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGALRM, &sa, NULL) != 0)
        return EX_IO;
    signal(SIGPIPE, SIG_IGN);
    alarm((unsigned)timeout_s);

    /* the XML: stdin, read whole; one byte over MAX_XML refuses it */
    char *xml = malloc(MAX_XML + 1);
    if (xml == NULL)
        return EX_NOMEM;
    size_t xml_len = 0;
    for (;;) {
        ssize_t r = read(STDIN_FILENO, xml + xml_len, MAX_XML + 1 - xml_len);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return EX_INPUT;
        }
        if (r == 0)
            break;
        xml_len += (size_t)r;
        if (xml_len > MAX_XML)
            return EX_INPUT;
    }
    if (memchr(xml, '\0', xml_len) != NULL)
        return EX_INPUT;

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
    if (rc != 0)
        return EX_CONNECT;
    /* a failed send still reads: an agent that refuses early may have answered */
    if (write_all(fd, head, hn) == 0)
        (void)write_all(fd, xml, xml_len);
    free(xml);

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
            return EX_IO;
        }
        if (r == 0) {
            parsed = http_body(ans, len, &body, &body_len, 1);
            break;
        }
        len += (size_t)r;
        if (len > MAX_ANSWER)
            return EX_ANSWER;
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
            /* the line as the agent built it, one per call; stderr errors are not worth a fallback */
            alarm(0);
            char *copy = ans;       /* reuse: line lies inside ans, move it to the front with its newline */
            memmove(copy, line, n);
            copy[n] = '\n';
            (void)write_all(STDERR_FILENO, copy, n + 1);
        }
    }
    return code;
}
