//go:build loomtest

package offload

// A mock host (the nginx side of include/loom_offload.h) for the package
// tests: a mutex/condvar queue in C. Built only with -tags loomtest,
// because cgo is not allowed in _test.go files.

/*
#cgo CFLAGS: -I${SRCDIR}/../../../include
#define LOOM_OFFLOAD_NO_PROTOTYPES
#include <loom_offload.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <errno.h>

struct loom_offload_task_s {
    struct loom_offload_task_s  *next;
    int                          id;
    int                          cancelled;
    size_t                       len;
    unsigned char               *req;
};

#define MOCK_MAX 4096

struct loom_offload_queue_s {
    pthread_mutex_t              mu;
    pthread_cond_t               cond;
    pthread_cond_t               done_cond;
    struct loom_offload_task_s  *head, *tail;
    int                          closed;
    int                          ndone;
    int                          status[MOCK_MAX];
    int                          answers[MOCK_MAX];
    char                        *rsp[MOCK_MAX];
    size_t                       rsp_len[MOCK_MAX];
    struct loom_offload_task_s  *tasks[MOCK_MAX];
    int                          nlogs;
};

static int
mock_wait(loom_offload_queue_t *q, int ms, loom_offload_task_t **task)
{
    struct timespec  ts;
    int              rc = 0;

    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long) (ms % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    pthread_mutex_lock(&q->mu);
    while (q->head == NULL && !q->closed && rc != ETIMEDOUT) {
        rc = pthread_cond_timedwait(&q->cond, &q->mu, &ts);
    }
    if (q->head != NULL) {
        *task = q->head;
        q->head = q->head->next;
        if (q->head == NULL) {
            q->tail = NULL;
        }
        pthread_mutex_unlock(&q->mu);
        return LOOM_OFFLOAD_TASK;
    }
    *task = NULL;
    rc = q->closed ? LOOM_OFFLOAD_CLOSED : LOOM_OFFLOAD_TIMEDOUT;
    pthread_mutex_unlock(&q->mu);
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

static loom_offload_queue_t  *mock_q;

static int
mock_answer(loom_offload_task_t *t, int status, const void *data, size_t len)
{
    loom_offload_queue_t  *q = mock_q;

    pthread_mutex_lock(&q->mu);
    q->status[t->id] = status;
    q->answers[t->id]++;
    q->rsp[t->id] = malloc(len + 1);
    memcpy(q->rsp[t->id], data, len);
    q->rsp_len[t->id] = len;
    q->ndone++;
    pthread_cond_broadcast(&q->done_cond);
    pthread_mutex_unlock(&q->mu);
    return 0;
}

static void
mock_log(loom_offload_queue_t *q, int level, const char *msg, size_t len)
{
    __atomic_add_fetch(&q->nlogs, 1, __ATOMIC_SEQ_CST);
}

static loom_offload_host_t  mock_host = {
    LOOM_OFFLOAD_ABI_VERSION, sizeof(loom_offload_host_t),
    mock_wait, mock_request, mock_cancelled, mock_answer, mock_log
};

static loom_offload_queue_t *
mock_new(void)
{
    loom_offload_queue_t  *q = calloc(1, sizeof(*q));

    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cond, NULL);
    pthread_cond_init(&q->done_cond, NULL);
    mock_q = q;
    return q;
}

static void
mock_post(loom_offload_queue_t *q, int id, const char *req, size_t len)
{
    struct loom_offload_task_s  *t = calloc(1, sizeof(*t));

    t->id = id;
    t->len = len;
    t->req = malloc(len + 1);
    memcpy(t->req, req, len);
    t->req[len] = '\0';
    pthread_mutex_lock(&q->mu);
    q->tasks[id] = t;
    if (q->tail) {
        q->tail->next = t;

    } else {
        q->head = t;
    }
    q->tail = t;
    pthread_cond_signal(&q->cond);
    pthread_mutex_unlock(&q->mu);
}

static void
mock_cancel(loom_offload_queue_t *q, int id)
{
    __atomic_store_n(&q->tasks[id]->cancelled, 1, __ATOMIC_SEQ_CST);
}

static int
mock_wait_done(loom_offload_queue_t *q, int n, int ms)
{
    struct timespec  ts;
    int              rc = 0, done;

    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000 + 1;
    pthread_mutex_lock(&q->mu);
    while (q->ndone < n && rc != ETIMEDOUT) {
        rc = pthread_cond_timedwait(&q->done_cond, &q->mu, &ts);
    }
    done = q->ndone;
    pthread_mutex_unlock(&q->mu);
    return done;
}

static void
mock_close(loom_offload_queue_t *q)
{
    pthread_mutex_lock(&q->mu);
    q->closed = 1;
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->mu);
}

static int
mock_init(loom_offload_queue_t *q, const char *cfg, unsigned threads,
    void **instance, char *err, size_t err_size)
{
    loom_offload_init_t  in;
    extern int loom_offload_init(loom_offload_init_t *init);

    memset(&in, 0, sizeof(in));
    in.abi_version = LOOM_OFFLOAD_ABI_VERSION;
    in.size = sizeof(in);
    in.host = &mock_host;
    in.queue = q;
    in.config = cfg;
    in.config_len = strlen(cfg);
    in.threads = threads;
    in.worker = 7;
    in.err = err;
    in.err_size = err_size;
    if (loom_offload_init(&in) != 0) {
        return -1;
    }
    *instance = in.instance;
    return 0;
}

static void
mock_shutdown(void *instance)
{
    extern void loom_offload_shutdown(void *instance);

    loom_offload_shutdown(instance);
}
*/
import "C"

import (
	"errors"
	"time"
	"unsafe"
)

type mockHost struct {
	q        *C.loom_offload_queue_t
	instance unsafe.Pointer
}

func startMock(config string, threads int) (*mockHost, error) {
	m := &mockHost{q: C.mock_new()}
	cfg := C.CString(config)
	defer C.free(unsafe.Pointer(cfg))
	errBuf := (*C.char)(C.calloc(256, 1))
	defer C.free(unsafe.Pointer(errBuf))
	var inst unsafe.Pointer
	if C.mock_init(m.q, cfg, C.uint(threads), &inst, errBuf, 256) != 0 {
		return nil, errors.New(C.GoString(errBuf))
	}
	m.instance = inst
	return m, nil
}

func (m *mockHost) post(id int, req string) {
	p := C.CString(req)
	defer C.free(unsafe.Pointer(p))
	C.mock_post(m.q, C.int(id), p, C.size_t(len(req)))
}

func (m *mockHost) cancel(id int) { C.mock_cancel(m.q, C.int(id)) }

func (m *mockHost) waitDone(n int, d time.Duration) int {
	return int(C.mock_wait_done(m.q, C.int(n), C.int(d.Milliseconds())))
}

// result returns the status, response and answer count of task id.
func (m *mockHost) result(id int) (int, string, int) {
	C.pthread_mutex_lock(&m.q.mu)
	defer C.pthread_mutex_unlock(&m.q.mu)
	return int(m.q.status[id]),
		C.GoStringN(m.q.rsp[id], C.int(m.q.rsp_len[id])),
		int(m.q.answers[id])
}

func (m *mockHost) close() {
	C.mock_close(m.q)
	C.mock_shutdown(m.instance)
}
