/*
 * Copyright (C) resty-loom authors
 *
 * The example C runtime for resty.loom.offload (include/loom_offload.h).
 *
 * Each offload.load() starts init->threads threads that take tasks from
 * the queue. A request is "<op> <argument>"; the answer is the op's result
 * or a runtime error:
 *
 *   echo <bytes>          the bytes
 *   sha256 <n> <bytes>    hex SHA-256 of the bytes, hashed n times (CPU)
 *   incr                  a counter kept by this instance (1, 2, ...)
 *   set <key> <value>     stores value in this instance's cache ("ok")
 *   get <key>             the cached value, or the error "not found"
 *   size <n>              n bytes of 'x'
 *   sleep <ms>            sleeps, checking the cancelled flag every 5 ms:
 *                         "slept" or "cancelled"
 *   stuck <ms>            sleeps, ignoring the cancelled flag ("done")
 *   fail <message>        the error <message>
 *   info                  "worker=<id> threads=<n> config=<config>"
 *
 * Configuration (space-separated key=value):
 *
 *   mode=echo             answer every request with its own bytes, no op
 *   init_delay_ms=<n>     sleep that long in init (a heavy start-up)
 *   init_fail=<message>   fail init with this message
 */


#include <loom_offload.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <openssl/sha.h>


#define CACHE_BUCKETS  256
#define CACHE_MAX      4096


typedef struct entry_s  entry_t;

struct entry_s {
    entry_t                    *next;
    size_t                      klen;
    size_t                      vlen;
    char                        bytes[1];      /* key, then value */
};


typedef struct {
    const loom_offload_host_t  *host;
    loom_offload_queue_t       *queue;
    pthread_t                  *tids;
    unsigned                    nthreads;
    int                         echo;
    int                         worker;
    char                       *config;

    pthread_mutex_t             lock;          /* counter and cache */
    unsigned long               counter;
    entry_t                    *cache[CACHE_BUCKETS];
    unsigned                    cached;
} rt_t;


static void
sleep_ms(long ms)
{
    struct timespec  ts;

    ts.tv_sec = ms / 1000;
    ts.tv_nsec = (ms % 1000) * 1000000;

    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
        /* void */
    }
}


static int
reply(rt_t *rt, loom_offload_task_t *t, int status, const char *s)
{
    return rt->host->answer(t, status, s, strlen(s));
}


static unsigned
hash_key(const char *k, size_t len)
{
    unsigned  h = 2166136261u;

    while (len--) {
        h = (h ^ (unsigned char) *k++) * 16777619u;
    }

    return h % CACHE_BUCKETS;
}


static void
op_set(rt_t *rt, loom_offload_task_t *t, const char *arg, size_t len)
{
    size_t      klen;
    entry_t    *e, **pe;
    const char *sp;
    unsigned    h;

    sp = memchr(arg, ' ', len);
    if (sp == NULL) {
        reply(rt, t, LOOM_OFFLOAD_ERROR, "usage: set <key> <value>");
        return;
    }

    klen = sp - arg;

    e = malloc(sizeof(entry_t) + len);
    if (e == NULL) {
        reply(rt, t, LOOM_OFFLOAD_ERROR, "no memory");
        return;
    }

    e->klen = klen;
    e->vlen = len - klen - 1;
    memcpy(e->bytes, arg, klen);
    memcpy(e->bytes + klen, sp + 1, e->vlen);

    h = hash_key(arg, klen);

    pthread_mutex_lock(&rt->lock);

    for (pe = &rt->cache[h]; *pe; pe = &(*pe)->next) {
        if ((*pe)->klen == klen && memcmp((*pe)->bytes, arg, klen) == 0) {
            entry_t  *old = *pe;
            e->next = old->next;
            *pe = e;
            free(old);
            goto done;
        }
    }

    if (rt->cached >= CACHE_MAX) {
        pthread_mutex_unlock(&rt->lock);
        free(e);
        reply(rt, t, LOOM_OFFLOAD_ERROR, "cache full");
        return;
    }

    e->next = rt->cache[h];
    rt->cache[h] = e;
    rt->cached++;

done:

    pthread_mutex_unlock(&rt->lock);
    reply(rt, t, LOOM_OFFLOAD_OK, "ok");
}


static void
op_get(rt_t *rt, loom_offload_task_t *t, const char *arg, size_t len)
{
    entry_t  *e;

    pthread_mutex_lock(&rt->lock);

    for (e = rt->cache[hash_key(arg, len)]; e; e = e->next) {
        if (e->klen == len && memcmp(e->bytes, arg, len) == 0) {
            /* answer() copies: safe under the lock, and cheap */
            rt->host->answer(t, LOOM_OFFLOAD_OK, e->bytes + e->klen,
                             e->vlen);
            pthread_mutex_unlock(&rt->lock);
            return;
        }
    }

    pthread_mutex_unlock(&rt->lock);
    reply(rt, t, LOOM_OFFLOAD_ERROR, "not found");
}


static void
op_sha256(rt_t *rt, loom_offload_task_t *t, const char *arg, size_t len)
{
    long           n, i;
    char          *end, hex[2 * SHA256_DIGEST_LENGTH + 1];
    unsigned char  md[SHA256_DIGEST_LENGTH];

    n = strtol(arg, &end, 10);
    if (end == arg || n < 1 || n > 10000000) {
        reply(rt, t, LOOM_OFFLOAD_ERROR, "usage: sha256 <n> <bytes>");
        return;
    }

    if (*end == ' ') {
        end++;
    }

    len -= end - arg;

    SHA256((const unsigned char *) end, len, md);

    for (i = 1; i < n; i++) {
        SHA256(md, sizeof(md), md);
    }

    for (i = 0; i < SHA256_DIGEST_LENGTH; i++) {
        sprintf(hex + 2 * i, "%02x", md[i]);
    }

    rt->host->answer(t, LOOM_OFFLOAD_OK, hex, 2 * SHA256_DIGEST_LENGTH);
}


static void
handle(rt_t *rt, loom_offload_task_t *t)
{
    long                  ms, waited;
    char                  buf[640], *p;
    size_t                len, oplen, alen;
    const char           *req, *arg, *sp;

    req = (const char *) rt->host->request(t, &len);

    if (rt->echo) {
        rt->host->answer(t, LOOM_OFFLOAD_OK, req, len);
        return;
    }

    sp = memchr(req, ' ', len);
    oplen = sp ? (size_t) (sp - req) : len;
    arg = sp ? sp + 1 : req + len;
    alen = len - (arg - req);

#define OP(name)  (oplen == sizeof(name) - 1 \
                   && memcmp(req, name, sizeof(name) - 1) == 0)

    if (OP("echo")) {
        rt->host->answer(t, LOOM_OFFLOAD_OK, arg, alen);

    } else if (OP("sha256")) {
        op_sha256(rt, t, arg, alen);

    } else if (OP("incr")) {
        pthread_mutex_lock(&rt->lock);
        ms = (long) ++rt->counter;
        pthread_mutex_unlock(&rt->lock);

        snprintf(buf, sizeof(buf), "%ld", ms);
        reply(rt, t, LOOM_OFFLOAD_OK, buf);

    } else if (OP("set")) {
        op_set(rt, t, arg, alen);

    } else if (OP("get")) {
        op_get(rt, t, arg, alen);

    } else if (OP("size")) {
        ms = strtol(arg, NULL, 10);
        if (ms < 0 || ms > 64 * 1024 * 1024) {
            reply(rt, t, LOOM_OFFLOAD_ERROR, "bad size");
            return;
        }

        p = malloc(ms + 1);
        if (p == NULL) {
            reply(rt, t, LOOM_OFFLOAD_ERROR, "no memory");
            return;
        }

        memset(p, 'x', ms);
        rt->host->answer(t, LOOM_OFFLOAD_OK, p, ms);
        free(p);

    } else if (OP("sleep")) {
        ms = strtol(arg, NULL, 10);

        for (waited = 0; waited < ms; waited += 5) {
            if (rt->host->cancelled(t)) {
                reply(rt, t, LOOM_OFFLOAD_OK, "cancelled");
                return;
            }

            sleep_ms(5);
        }

        reply(rt, t, LOOM_OFFLOAD_OK, "slept");

    } else if (OP("stuck")) {
        sleep_ms(strtol(arg, NULL, 10));
        reply(rt, t, LOOM_OFFLOAD_OK, "done");

    } else if (OP("fail")) {
        rt->host->answer(t, LOOM_OFFLOAD_ERROR, arg, alen);

    } else if (OP("info")) {
        snprintf(buf, sizeof(buf), "worker=%d threads=%u config=%.512s",
                 rt->worker, rt->nthreads, rt->config);
        reply(rt, t, LOOM_OFFLOAD_OK, buf);

    } else {
        snprintf(buf, sizeof(buf), "unknown op \"%.*s\"",
                 (int) (oplen > 64 ? 64 : oplen), req);
        reply(rt, t, LOOM_OFFLOAD_ERROR, buf);
    }

#undef OP
}


static void *
worker_thread(void *data)
{
    rt_t                 *rt = data;
    int                   rc;
    loom_offload_task_t  *t;

    for ( ;; ) {
        rc = rt->host->wait(rt->queue, 1000, &t);

        if (rc == LOOM_OFFLOAD_CLOSED) {
            return NULL;
        }

        if (rc == LOOM_OFFLOAD_TASK) {
            handle(rt, t);
        }
    }
}


/* the value of "key=" in the configuration, or NULL; sets *len */
static const char *
config_get(const char *config, const char *key, size_t *len)
{
    size_t       klen;
    const char  *p, *end;

    klen = strlen(key);

    for (p = config; *p; ) {
        while (*p == ' ') {
            p++;
        }

        end = strchr(p, ' ');
        if (end == NULL) {
            end = p + strlen(p);
        }

        if ((size_t) (end - p) > klen && p[klen] == '='
            && memcmp(p, key, klen) == 0)
        {
            *len = end - p - klen - 1;
            return p + klen + 1;
        }

        p = end;
    }

    return NULL;
}


static void
free_rt(rt_t *rt)
{
    unsigned  i;
    entry_t  *e, *next;

    for (i = 0; i < CACHE_BUCKETS; i++) {
        for (e = rt->cache[i]; e; e = next) {
            next = e->next;
            free(e);
        }
    }

    pthread_mutex_destroy(&rt->lock);
    free(rt->tids);
    free(rt->config);
    free(rt);
}


int
loom_offload_init(loom_offload_init_t *init)
{
    rt_t        *rt;
    size_t       len;
    unsigned     i;
    const char  *v;

    if (init->abi_version < 1
        || init->host->size < sizeof(loom_offload_host_t))
    {
        snprintf(init->err, init->err_size, "host ABI too old");
        return -1;
    }

    v = config_get(init->config, "init_fail", &len);
    if (v) {
        snprintf(init->err, init->err_size, "%.*s", (int) len, v);
        return -1;
    }

    v = config_get(init->config, "init_delay_ms", &len);
    if (v) {
        sleep_ms(strtol(v, NULL, 10));
    }

    rt = calloc(1, sizeof(rt_t));
    if (rt == NULL) {
        snprintf(init->err, init->err_size, "no memory");
        return -1;
    }

    rt->host = init->host;
    rt->queue = init->queue;
    rt->worker = init->worker;
    rt->config = strdup(init->config);
    rt->tids = calloc(init->threads, sizeof(pthread_t));

    v = config_get(init->config, "mode", &len);
    rt->echo = v && len == 4 && memcmp(v, "echo", 4) == 0;

    if (rt->config == NULL || rt->tids == NULL
        || pthread_mutex_init(&rt->lock, NULL) != 0)
    {
        free(rt->tids);
        free(rt->config);
        free(rt);
        snprintf(init->err, init->err_size, "no memory");
        return -1;
    }

    for (i = 0; i < init->threads; i++) {
        if (pthread_create(&rt->tids[i], NULL, worker_thread, rt) != 0) {
            break;
        }

        rt->nthreads++;
    }

    if (rt->nthreads == 0) {
        free_rt(rt);
        snprintf(init->err, init->err_size, "cannot create threads");
        return -1;
    }

    init->instance = rt;

    return 0;
}


void
loom_offload_shutdown(void *instance)
{
    rt_t      *rt = instance;
    unsigned   i;

    /* the queue is closed: every thread returns from wait() and exits */
    for (i = 0; i < rt->nthreads; i++) {
        pthread_join(rt->tids[i], NULL);
    }

    free_rt(rt);
}
