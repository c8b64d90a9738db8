/*
 * The benchmark's Pub/Sub sink: answers publish requests at a fraction of
 * the CPU a Python server needs, because it shares the two cores with nginx
 * and wrk and what it spends is taken from what is measured. Driven by
 * tests/pubsub/sink.py (FastSink), which starts it and reads its counters.
 *
 *   pubsub-sink        binds 127.0.0.1 on a free port, prints the port on
 *                      stdout, serves until its stdin is closed
 *
 * Any POST whose path ends in ":publish" is accepted: the messages with data
 * are counted without parsing the JSON (base64 holds no quote, so each data
 * value ends at the next quote) and each gets a message ID. GET /_sink/stats
 * answers the counters as JSON. Anything else gets a 404. HTTP/1.1 with
 * keep-alive and pipelining; Content-Length bodies only.
 */

#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define READ_SIZE   (256 * 1024)
#define HEADER_MAX  (64 * 1024)
#define PUBLISH     ":publish"
#define DATA_FIELD  "\"data\":\""

typedef struct {
    char   *p;
    size_t  len;
    size_t  cap;
} buf_t;

typedef struct {
    int     fd;
    buf_t   in;
    buf_t   out;
    size_t  sent;       /* bytes of out already written */
} conn_t;

static unsigned long long  messages, requests, body_bytes, connections;
static unsigned long long  next_id = 1;
static int                 ep;
static buf_t               scratch;


static void
die(const char *what)
{
    perror(what);
    exit(1);
}


static void
reserve(buf_t *b, size_t more)
{
    if (b->cap - b->len >= more) {
        return;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap - b->len < more) {
        cap *= 2;
    }
    b->p = realloc(b->p, cap);
    if (b->p == NULL) {
        die("realloc");
    }
    b->cap = cap;
}


static void
put(buf_t *b, const char *s, size_t n)
{
    reserve(b, n);
    memcpy(b->p + b->len, s, n);
    b->len += n;
}


static void
respond(conn_t *c, const char *status, const char *body, size_t n)
{
    char  head[160];
    int   h = snprintf(head, sizeof(head), "HTTP/1.1 %s\r\nContent-Type: "
                       "application/json\r\nContent-Length: %zu\r\n\r\n",
                       status, n);
    put(&c->out, head, (size_t) h);
    put(&c->out, body, n);
}


static size_t
count_data_fields(const char *p, const char *end)
{
    size_t      n = 0;
    const char *q;

    while ((q = memmem(p, (size_t) (end - p), DATA_FIELD,
                       sizeof(DATA_FIELD) - 1)) != NULL)
    {
        n++;
        p = q + sizeof(DATA_FIELD) - 1;
        q = memchr(p, '"', (size_t) (end - p));
        if (q == NULL) {
            break;
        }
        p = q + 1;
    }
    return n;
}


static void
publish(conn_t *c, const char *body, size_t length)
{
    size_t  n = count_data_fields(body, body + length);
    char    id[24];

    messages += n;
    requests++;
    body_bytes += length;
    scratch.len = 0;
    put(&scratch, "{\"messageIds\":[", 15);
    for (size_t i = 0; i < n; i++) {
        int k = snprintf(id, sizeof(id), i ? ",\"%llu\"" : "\"%llu\"",
                         next_id++);
        put(&scratch, id, (size_t) k);
    }
    put(&scratch, "]}", 2);
    respond(c, "200 OK", scratch.p, scratch.len);
}


/* answers the request at p once it is complete and returns its length;
 * 0 while it is incomplete, -1 for one that cannot be served */
static long
request(conn_t *c, char *p, size_t have)
{
    char   *end, *line, *sp, *path;
    size_t  length = 0, head;

    end = memmem(p, have < HEADER_MAX ? have : HEADER_MAX, "\r\n\r\n", 4);
    if (end == NULL) {
        return have >= HEADER_MAX ? -1 : 0;
    }
    head = (size_t) (end - p) + 4;
    for (line = memchr(p, '\n', head); line && line < end;
         line = memchr(line + 1, '\n', (size_t) (end - line)))
    {
        if (strncasecmp(line + 1, "content-length:", 15) == 0) {
            char *e;
            long  v = strtol(line + 16, &e, 10);
            if (v < 0 || e == line + 16) {
                return -1;
            }
            length = (size_t) v;
        }
    }
    if (have < head + length) {
        return 0;
    }
    sp = memchr(p, ' ', head);
    path = sp ? sp + 1 : NULL;
    sp = path ? memchr(path, ' ', (size_t) (end - path)) : NULL;
    if (sp && strncmp(p, "POST ", 5) == 0
        && (size_t) (sp - path) >= sizeof(PUBLISH) - 1
        && memcmp(sp - (sizeof(PUBLISH) - 1), PUBLISH,
                  sizeof(PUBLISH) - 1) == 0)
    {
        publish(c, p + head, length);

    } else if (sp && strncmp(p, "GET /_sink/stats ", 17) == 0) {
        char  body[200];
        int   n = snprintf(body, sizeof(body), "{\"messages\":%llu,"
                           "\"requests\":%llu,\"bytes\":%llu,"
                           "\"connections\":%llu}", messages, requests,
                           body_bytes, connections);
        respond(c, "200 OK", body, (size_t) n);

    } else {
        respond(c, "404 Not Found", "{\"error\":{\"code\":404}}", 22);
    }
    return (long) (head + length);
}


static void
drop(conn_t *c)
{
    close(c->fd);       /* also leaves the epoll set */
    free(c->in.p);
    free(c->out.p);
    free(c);
}


static void
watch(conn_t *c, int op)
{
    struct epoll_event  ev;

    /* a connection with unsent output is not read until it is sent */
    ev.events = c->out.len > c->sent ? EPOLLOUT : EPOLLIN;
    ev.data.ptr = c;
    if (epoll_ctl(ep, op, c->fd, &ev) < 0) {
        die("epoll_ctl");
    }
}


/* writes what it can; 0 when everything went, 1 when some waits, -1 */
static int
flush_out(conn_t *c)
{
    while (c->sent < c->out.len) {
        ssize_t n = write(c->fd, c->out.p + c->sent, c->out.len - c->sent);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            return errno == EAGAIN ? 1 : -1;
        }
        c->sent += (size_t) n;
    }
    c->out.len = 0;
    c->sent = 0;
    return 0;
}


static void
on_readable(conn_t *c)
{
    long     n;
    size_t   used = 0;
    ssize_t  got;

    reserve(&c->in, READ_SIZE);
    got = read(c->fd, c->in.p + c->in.len, c->in.cap - c->in.len);
    if (got <= 0) {
        if (got < 0 && (errno == EAGAIN || errno == EINTR)) {
            return;
        }
        drop(c);
        return;
    }
    c->in.len += (size_t) got;

    for (;;) {
        n = request(c, c->in.p + used, c->in.len - used);
        if (n < 0) {
            drop(c);
            return;
        }
        if (n == 0) {
            break;
        }
        used += (size_t) n;
    }
    if (used) {
        memmove(c->in.p, c->in.p + used, c->in.len - used);
        c->in.len -= used;
    }
    if (c->out.len) {
        int r = flush_out(c);
        if (r < 0) {
            drop(c);
        } else if (r > 0) {
            watch(c, EPOLL_CTL_MOD);
        }
    }
}


static void
on_writable(conn_t *c)
{
    int r = flush_out(c);
    if (r < 0) {
        drop(c);
    } else if (r == 0) {
        watch(c, EPOLL_CTL_MOD);
    }
}


int
main(void)
{
    struct sockaddr_in  sa;
    socklen_t           sl = sizeof(sa);
    struct epoll_event  ev, events[64];
    int                 ls, one = 1;

    signal(SIGPIPE, SIG_IGN);
    ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (ls < 0) {
        die("socket");
    }
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *) &sa, sizeof(sa)) < 0
        || listen(ls, 1024) < 0
        || getsockname(ls, (struct sockaddr *) &sa, &sl) < 0)
    {
        die("listen");
    }
    printf("%d\n", ntohs(sa.sin_port));
    fflush(stdout);

    ep = epoll_create1(0);
    if (ep < 0) {
        die("epoll_create1");
    }
    ev.events = EPOLLIN;
    ev.data.ptr = NULL;                 /* the listener */
    epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev);
    ev.data.ptr = &ep;                  /* stdin: closed means stop */
    epoll_ctl(ep, EPOLL_CTL_ADD, 0, &ev);

    for (;;) {
        int n = epoll_wait(ep, events, 64, -1);
        if (n < 0 && errno != EINTR) {
            die("epoll_wait");
        }
        for (int i = 0; i < n; i++) {
            void *who = events[i].data.ptr;
            if (who == &ep) {
                char  b[64];
                if (read(0, b, sizeof(b)) <= 0) {
                    return 0;
                }

            } else if (who == NULL) {
                int fd;
                while ((fd = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    conn_t *c = calloc(1, sizeof(conn_t));
                    if (c == NULL) {
                        die("calloc");
                    }
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one,
                               sizeof(one));
                    c->fd = fd;
                    connections++;
                    watch(c, EPOLL_CTL_ADD);
                }

            } else if (events[i].events & EPOLLOUT) {
                on_writable(who);

            } else {
                on_readable(who);
            }
        }
    }
}
