/*
 * Copyright (C) resty-loom authors
 *
 * A runtime that breaks the C ABI on purpose, for the tests of how the
 * host copes (tests/test_offload_limits.py); not an example to follow.
 * One thread; a request names the mistake:
 *
 *   twice     answers "first", then answers the same task again
 *   never     keeps the task and never answers it
 *   nulldata  answers with data NULL and a length of 16
 *   ghost     answers a task that was never taken, then "ghosted"
 *   rc        the host's return value of the last mistaken answer()
 *   other     answered with its own bytes
 */


#include <loom_offload.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


typedef struct {
    const loom_offload_host_t  *host;
    loom_offload_queue_t       *queue;
    pthread_t                   tid;
    int                         last_rc;
} misuse_t;


static void *
misuse_thread(void *data)
{
    misuse_t             *rt = data;
    int                   rc;
    char                  buf[32];
    size_t                len;
    const char           *req;
    loom_offload_task_t  *t;
    static char           ghost[256];

    for ( ;; ) {
        rc = rt->host->wait(rt->queue, 1000, &t);

        if (rc == LOOM_OFFLOAD_CLOSED) {
            return NULL;
        }

        if (rc != LOOM_OFFLOAD_TASK) {
            continue;
        }

        req = (const char *) rt->host->request(t, &len);

        if (strcmp(req, "twice") == 0) {
            rt->host->answer(t, LOOM_OFFLOAD_OK, "first", 5);
            rt->last_rc = rt->host->answer(t, LOOM_OFFLOAD_OK, "second", 6);

        } else if (strcmp(req, "never") == 0) {
            /* lost */

        } else if (strcmp(req, "nulldata") == 0) {
            rt->last_rc = rt->host->answer(t, LOOM_OFFLOAD_OK, NULL, 16);

        } else if (strcmp(req, "ghost") == 0) {
            rt->last_rc = rt->host->answer((loom_offload_task_t *) ghost,
                                           LOOM_OFFLOAD_OK, "boo", 3);
            rt->host->answer(t, LOOM_OFFLOAD_OK, "ghosted", 7);

        } else if (strcmp(req, "rc") == 0) {
            snprintf(buf, sizeof(buf), "%d", rt->last_rc);
            rt->host->answer(t, LOOM_OFFLOAD_OK, buf, strlen(buf));

        } else {
            rt->host->answer(t, LOOM_OFFLOAD_OK, req, len);
        }
    }
}


int
loom_offload_init(loom_offload_init_t *init)
{
    misuse_t  *rt;

    rt = calloc(1, sizeof(misuse_t));
    if (rt == NULL) {
        snprintf(init->err, init->err_size, "no memory");
        return -1;
    }

    rt->host = init->host;
    rt->queue = init->queue;

    if (pthread_create(&rt->tid, NULL, misuse_thread, rt) != 0) {
        free(rt);
        snprintf(init->err, init->err_size, "cannot create a thread");
        return -1;
    }

    init->instance = rt;

    return 0;
}


void
loom_offload_shutdown(void *instance)
{
    misuse_t  *rt = instance;

    pthread_join(rt->tid, NULL);
    free(rt);
}
