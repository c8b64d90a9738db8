/*
 * Copyright (C) resty-loom authors
 *
 * Drives the example C runtime through a mock host, without nginx: the
 * ABI of include/loom_offload.h is all a runtime needs.
 */


#include <loom_offload.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


struct loom_offload_task_s {
    loom_offload_task_t  *next;
    int                   cancelled;
    int                   answered;
    int                   status;
    char                  rsp[1024];
    size_t                rsp_len;
    size_t                req_len;
    unsigned char         req[256];
};


struct loom_offload_queue_s {
    pthread_mutex_t       mtx;
    pthread_cond_t        cond;      /* tasks and answers */
    loom_offload_task_t  *head;
    int                   closed;
};


static int failures;


static int
mock_wait(loom_offload_queue_t *q, int timeout_ms, loom_offload_task_t **t)
{
    struct timespec  ts;

    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_ms / 1000 + 1;

    pthread_mutex_lock(&q->mtx);

    while (q->head == NULL && !q->closed) {
        if (pthread_cond_timedwait(&q->cond, &q->mtx, &ts) != 0) {
            pthread_mutex_unlock(&q->mtx);
            return LOOM_OFFLOAD_TIMEDOUT;
        }
    }

    if (q->head == NULL) {
        pthread_mutex_unlock(&q->mtx);
        *t = NULL;
        return LOOM_OFFLOAD_CLOSED;
    }

    *t = q->head;
    q->head = (*t)->next;
    pthread_mutex_unlock(&q->mtx);

    return LOOM_OFFLOAD_TASK;
}


static const unsigned char *
mock_request(loom_offload_task_t *t, size_t *len)
{
    *len = t->req_len;
    return t->req;
}


static int
mock_cancelled(loom_offload_task_t *t)
{
    return __atomic_load_n(&t->cancelled, __ATOMIC_ACQUIRE);
}


static loom_offload_queue_t  queue;


static int
mock_answer(loom_offload_task_t *t, int status, const void *data,
    size_t len)
{
    pthread_mutex_lock(&queue.mtx);

    if (t->answered) {
        printf("not ok: task answered twice\n");
        failures++;
    }

    t->status = status;
    t->rsp_len = len < sizeof(t->rsp) ? len : sizeof(t->rsp);
    memcpy(t->rsp, data, t->rsp_len);
    t->answered = 1;

    pthread_cond_broadcast(&queue.cond);
    pthread_mutex_unlock(&queue.mtx);

    return 0;
}


static void
mock_log(loom_offload_queue_t *q, int level, const char *msg, size_t len)
{
    printf("log %d: %.*s\n", level, (int) len, msg);
}


static const loom_offload_host_t  host = {
    LOOM_OFFLOAD_ABI_VERSION, sizeof(loom_offload_host_t),
    mock_wait, mock_request, mock_cancelled, mock_answer, mock_log
};


static void
submit(loom_offload_task_t *t, const char *req)
{
    loom_offload_task_t  **p;

    memset(t, 0, sizeof(*t));
    t->req_len = strlen(req);
    memcpy(t->req, req, t->req_len + 1);

    pthread_mutex_lock(&queue.mtx);
    for (p = &queue.head; *p; p = &(*p)->next) { /* void */ }
    *p = t;
    pthread_cond_broadcast(&queue.cond);
    pthread_mutex_unlock(&queue.mtx);
}


static void
await(loom_offload_task_t *t)
{
    pthread_mutex_lock(&queue.mtx);
    while (!t->answered) {
        pthread_cond_wait(&queue.cond, &queue.mtx);
    }
    pthread_mutex_unlock(&queue.mtx);
}


static void
expect(const char *req, int status, const char *rsp)
{
    loom_offload_task_t  t;

    submit(&t, req);
    await(&t);

    if (t.status != status || t.rsp_len != strlen(rsp)
        || memcmp(t.rsp, rsp, t.rsp_len) != 0)
    {
        printf("not ok: %s -> %d \"%.*s\", expected %d \"%s\"\n", req,
               t.status, (int) t.rsp_len, t.rsp, status, rsp);
        failures++;
        return;
    }

    printf("ok %s\n", req);
}


int
main(void)
{
    char                 err[256];
    loom_offload_init_t  ii;
    loom_offload_task_t  t;

    pthread_mutex_init(&queue.mtx, NULL);
    pthread_cond_init(&queue.cond, NULL);

    memset(&ii, 0, sizeof(ii));
    ii.abi_version = LOOM_OFFLOAD_ABI_VERSION;
    ii.size = sizeof(ii);
    ii.host = &host;
    ii.queue = &queue;
    ii.config = "init_fail=broken";
    ii.config_len = strlen(ii.config);
    ii.threads = 2;
    ii.err = err;
    ii.err_size = sizeof(err);

    if (loom_offload_init(&ii) == 0 || strcmp(err, "broken") != 0) {
        printf("not ok: init_fail\n");
        return 1;
    }

    ii.config = "cache=1";
    ii.config_len = strlen(ii.config);

    if (loom_offload_init(&ii) != 0) {
        printf("not ok: init: %s\n", err);
        return 1;
    }

    expect("echo hello", LOOM_OFFLOAD_OK, "hello");
    expect("incr", LOOM_OFFLOAD_OK, "1");
    expect("incr", LOOM_OFFLOAD_OK, "2");
    expect("get k", LOOM_OFFLOAD_ERROR, "not found");
    expect("set k v1", LOOM_OFFLOAD_OK, "ok");
    expect("set k value 2", LOOM_OFFLOAD_OK, "ok");
    expect("get k", LOOM_OFFLOAD_OK, "value 2");
    expect("sha256 1 abc", LOOM_OFFLOAD_OK,
           "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    expect("fail boom", LOOM_OFFLOAD_ERROR, "boom");
    expect("nope", LOOM_OFFLOAD_ERROR, "unknown op \"nope\"");
    expect("info", LOOM_OFFLOAD_OK, "worker=0 threads=2 config=cache=1");

    /* a long task stops early once cancelled */
    submit(&t, "sleep 10000");
    __atomic_store_n(&t.cancelled, 1, __ATOMIC_RELEASE);
    await(&t);

    if (t.rsp_len != 9 || memcmp(t.rsp, "cancelled", 9) != 0) {
        printf("not ok: cancelled sleep\n");
        failures++;

    } else {
        printf("ok cancelled\n");
    }

    /* closing the queue stops the threads; shutdown joins them */
    pthread_mutex_lock(&queue.mtx);
    queue.closed = 1;
    pthread_cond_broadcast(&queue.cond);
    pthread_mutex_unlock(&queue.mtx);

    loom_offload_shutdown(ii.instance);
    printf("ok shutdown\n");

    if (failures) {
        printf("%d failure(s)\n", failures);
        return 1;
    }

    return 0;
}
