
/*
 * Copyright (C) resty-loom authors
 *
 * A mock host for the Python runtime: loads the runtime like the nginx
 * module does (dlopen RTLD_LOCAL, init on a thread with every signal
 * blocked), runs tasks against examples/loom_example.py and checks the
 * answers. Usage: mock_host <libloom_rt_python.so> <examples dir>
 */


#define _GNU_SOURCE
#include <loom_offload.h>

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>


#define MAX_TASKS  4096


struct loom_offload_task_s {
    struct loom_offload_task_s  *next;
    int                          id;
    int                          cancelled;
    size_t                       len;
    unsigned char               *req;
};


struct loom_offload_queue_s {
    pthread_mutex_t              mu;
    pthread_cond_t               cond;
    pthread_cond_t               done_cond;
    loom_offload_task_t         *head, *tail;
    int                          closed;
    int                          ndone;
    int                          nlogs;
};


static loom_offload_queue_t   q = {
    PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
    PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0, 0
};
static loom_offload_task_t   *tasks[MAX_TASKS];
static int                    status[MAX_TASKS];
static int                    answers[MAX_TASKS];
static char                  *rsp[MAX_TASKS];
static int                    next_id;
static int                    failures;


static int
mock_wait(loom_offload_queue_t *queue, int ms, loom_offload_task_t **task)
{
    int              rc = 0;
    struct timespec  ts;

    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long) (ms % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }

    pthread_mutex_lock(&queue->mu);
    while (queue->head == NULL && !queue->closed && rc != ETIMEDOUT) {
        rc = pthread_cond_timedwait(&queue->cond, &queue->mu, &ts);
    }

    if (queue->head != NULL) {
        *task = queue->head;
        queue->head = queue->head->next;
        if (queue->head == NULL) {
            queue->tail = NULL;
        }
        pthread_mutex_unlock(&queue->mu);
        return LOOM_OFFLOAD_TASK;
    }

    *task = NULL;
    rc = queue->closed ? LOOM_OFFLOAD_CLOSED : LOOM_OFFLOAD_TIMEDOUT;
    pthread_mutex_unlock(&queue->mu);
    return rc;
}


static const unsigned char *
mock_request(loom_offload_task_t *t, size_t *len)
{
    *len = t->len;
    return t->req;
}


static int
mock_cancelled(loom_offload_task_t *t)
{
    return __atomic_load_n(&t->cancelled, __ATOMIC_SEQ_CST);
}


static int
mock_answer(loom_offload_task_t *t, int st, const void *data, size_t len)
{
    char  *copy;

    copy = malloc(len + 1);
    if (len) {
        memcpy(copy, data, len);
    }
    copy[len] = '\0';

    pthread_mutex_lock(&q.mu);
    status[t->id] = st;
    answers[t->id]++;
    rsp[t->id] = copy;
    q.ndone++;
    pthread_cond_broadcast(&q.done_cond);
    pthread_mutex_unlock(&q.mu);
    return 0;
}


static void
mock_log(loom_offload_queue_t *queue, int level, const char *msg,
    size_t len)
{
    __atomic_add_fetch(&queue->nlogs, 1, __ATOMIC_SEQ_CST);
}


static loom_offload_host_t  host = {
    LOOM_OFFLOAD_ABI_VERSION, sizeof(loom_offload_host_t),
    mock_wait, mock_request, mock_cancelled, mock_answer, mock_log
};


static int
post(const char *req)
{
    int                   id;
    loom_offload_task_t  *t;

    t = calloc(1, sizeof(*t));
    id = ++next_id;
    t->id = id;
    t->len = strlen(req);
    t->req = (unsigned char *) strdup(req);

    pthread_mutex_lock(&q.mu);
    tasks[id] = t;
    if (q.tail) {
        q.tail->next = t;

    } else {
        q.head = t;
    }
    q.tail = t;
    pthread_cond_signal(&q.cond);
    pthread_mutex_unlock(&q.mu);

    return id;
}


static void
wait_done(int n)
{
    int              rc = 0;
    struct timespec  ts;

    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 20;

    pthread_mutex_lock(&q.mu);
    while (q.ndone < n && rc != ETIMEDOUT) {
        rc = pthread_cond_timedwait(&q.done_cond, &q.mu, &ts);
    }
    pthread_mutex_unlock(&q.mu);

    if (q.ndone < n) {
        fprintf(stderr, "FAIL: %d of %d tasks answered\n", q.ndone, n);
        exit(1);
    }
}


static const char *
call(const char *req, int *st)
{
    int  id = post(req);

    wait_done(id);
    *st = status[id];
    return rsp[id];
}


#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);            \
            fprintf(stderr, __VA_ARGS__);                                   \
            fprintf(stderr, "\n");                                          \
            failures++;                                                     \
        }                                                                   \
    } while (0)


typedef struct {
    loom_offload_init_pt   init;
    loom_offload_init_t   *args;
    int                    rc;
} start_t;


static void *
start_thread(void *arg)
{
    start_t  *s = arg;

    s->rc = s->init(s->args);
    return NULL;
}


/* init on a thread with all signals blocked, as the host does */
static int
start(loom_offload_init_pt init, const char *cfg, unsigned threads,
    void **instance, char *err, size_t err_size)
{
    sigset_t             all, old;
    start_t              s;
    pthread_t            tid;
    loom_offload_init_t  args;

    memset(&args, 0, sizeof(args));
    args.abi_version = LOOM_OFFLOAD_ABI_VERSION;
    args.size = sizeof(args);
    args.host = &host;
    args.queue = &q;
    args.config = cfg;
    args.config_len = strlen(cfg);
    args.threads = threads;
    args.worker = 0;
    args.err = err;
    args.err_size = err_size;
    err[0] = '\0';

    s.init = init;
    s.args = &args;
    s.rc = -1;

    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_create(&tid, NULL, start_thread, &s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_join(tid, NULL);

    *instance = args.instance;
    return s.rc;
}


int
main(int argc, char **argv)
{
    int                       st, i, id, first, rc;
    char                      cfg[1024], err[1024], req[64], want[64];
    void                     *lib, *instance;
    const char               *r;
    loom_offload_init_pt      init;
    loom_offload_shutdown_pt  shutdown;

    if (argc != 3) {
        fprintf(stderr, "usage: %s <runtime.so> <examples dir>\n", argv[0]);
        return 2;
    }

    lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        fprintf(stderr, "FAIL: %s\n", dlerror());
        return 1;
    }

    init = (loom_offload_init_pt) dlsym(lib, "loom_offload_init");
    shutdown = (loom_offload_shutdown_pt) dlsym(lib, "loom_offload_shutdown");
    CHECK(init && shutdown, "symbols missing");

    /* start-up failures are reported in err */

    rc = start(init, "function=handle", 1, &instance, err, sizeof(err));
    CHECK(rc != 0 && strstr(err, "module=") != NULL, "no module: %s", err);

    snprintf(cfg, sizeof(cfg), "path=%s module=no_such_module", argv[2]);
    rc = start(init, cfg, 1, &instance, err, sizeof(err));
    CHECK(rc != 0 && strstr(err, "ModuleNotFoundError") != NULL,
          "missing module: %s", err);

    snprintf(cfg, sizeof(cfg), "path=%s module=loom_example function=nope",
             argv[2]);
    rc = start(init, cfg, 1, &instance, err, sizeof(err));
    CHECK(rc != 0 && strstr(err, "AttributeError") != NULL,
          "missing function: %s", err);

    snprintf(cfg, sizeof(cfg), "path=%s module=loom_example function=handle",
             argv[2]);
    rc = start(init, cfg, 4, &instance, err, sizeof(err));
    CHECK(rc == 0 && instance != NULL, "start: %s", err);
    if (rc != 0) {
        return 1;
    }

    r = call("echo:hello", &st);
    CHECK(st == LOOM_OFFLOAD_OK && strcmp(r, "hello") == 0, "echo: %s", r);

    r = call("sha256:abc", &st);
    CHECK(st == LOOM_OFFLOAD_OK && strcmp(r, "ba7816bf8f01cfea414140de5dae2223"
          "b00361a396177a9cb410ff61f20015ad") == 0, "sha256: %s", r);

    r = call("put:k=v1", &st);
    CHECK(st == LOOM_OFFLOAD_OK && strcmp(r, "ok") == 0, "put: %s", r);
    r = call("get:k", &st);
    CHECK(st == LOOM_OFFLOAD_OK && strcmp(r, "v1") == 0, "get: %s", r);

    r = call("raise:boom", &st);
    CHECK(st == LOOM_OFFLOAD_ERROR
          && strncmp(r, "ValueError: boom\nTraceback (most recent call "
                     "last):\n", 52) == 0
          && strstr(r, "loom_example.py\", line ") != NULL
          && strstr(r, "in handle") != NULL, "raise: %s", r);

    r = call("int:5", &st);
    CHECK(st == LOOM_OFFLOAD_ERROR
          && strncmp(r, "TypeError: handler returned int, expected bytes",
                     47) == 0, "int: %s", r);

    r = call("get:k", &st);
    CHECK(st == LOOM_OFFLOAD_OK && strcmp(r, "v1") == 0, "state: %s", r);

    r = call("view:buffer", &st);
    CHECK(st == LOOM_OFFLOAD_OK && strcmp(r, "buffer") == 0, "view: %s", r);

    /* cancellation reaches loom.cancelled() */
    id = post("sleep:5000");
    usleep(50000);
    __atomic_store_n(&tasks[id]->cancelled, 1, __ATOMIC_SEQ_CST);
    wait_done(id);
    CHECK(strcmp(rsp[id], "cancelled") == 0, "cancel: %s", rsp[id]);

    /* many tasks on 4 threads, each answered once */
    first = next_id + 1;
    for (i = 0; i < 2000; i++) {
        snprintf(req, sizeof(req), "echo:t%d", i);
        post(req);
    }
    wait_done(next_id);
    for (i = 0; i < 2000; i++) {
        snprintf(want, sizeof(want), "t%d", i);
        CHECK(answers[first + i] == 1 && strcmp(rsp[first + i], want) == 0,
              "task %d: %d answers, %s", i, answers[first + i],
              rsp[first + i]);
    }

    r = call("count:", &st);
    CHECK(st == LOOM_OFFLOAD_OK && atoi(r) == next_id,
          "count: %s (calls %d)", r, next_id);

    /* shutdown: close the queue, then the runtime joins its threads */
    pthread_mutex_lock(&q.mu);
    q.closed = 1;
    pthread_cond_broadcast(&q.cond);
    pthread_mutex_unlock(&q.mu);
    shutdown(instance);

    if (failures) {
        fprintf(stderr, "%d failure(s)\n", failures);
        return 1;
    }

    printf("ok: python runtime against the mock host (%d tasks)\n", next_id);
    return 0;
}
