package offload

/*
#cgo CFLAGS: -I${SRCDIR}/../../../include -O2

#define LOOM_OFFLOAD_NO_PROTOTYPES
#include <loom_offload.h>
#include <errno.h>
#include <signal.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

// cgo cannot call through C function pointers: small trampolines.

static int
loom_go_wait(const loom_offload_host_t *h, loom_offload_queue_t *q,
    int timeout_ms, loom_offload_task_t **task)
{
    return h->wait(q, timeout_ms, task);
}

static const unsigned char *
loom_go_request(const loom_offload_host_t *h, loom_offload_task_t *t,
    size_t *len)
{
    return h->request(t, len);
}

static int
loom_go_cancelled(const loom_offload_host_t *h, loom_offload_task_t *t)
{
    return h->cancelled(t);
}

static int
loom_go_answer(const loom_offload_host_t *h, loom_offload_task_t *t,
    int status, const void *data, size_t len)
{
    return h->answer(t, status, data, len);
}

static void
loom_go_log(const loom_offload_host_t *h, loom_offload_queue_t *q,
    int level, const char *msg, size_t len)
{
    h->log(q, level, msg, len);
}

static void
loom_go_set_err(loom_offload_init_t *init, const char *msg, size_t len)
{
    if (init->err == NULL || init->err_size == 0) {
        return;
    }
    if (len > init->err_size - 1) {
        len = init->err_size - 1;
    }
    memcpy(init->err, msg, len);
    init->err[len] = '\0';
}

// Leaves asynchronous signals to nginx's main thread (faults stay
// deliverable, as in nginx's thread pool). Go starts its threads with the
// mask of the thread that loaded the library, which the host blocks; this
// keeps it blocked on a thread even if a host does not.
static void
loom_go_block_signals(void)
{
    sigset_t  set;

    sigfillset(&set);
    sigdelset(&set, SIGILL);
    sigdelset(&set, SIGBUS);
    sigdelset(&set, SIGFPE);
    sigdelset(&set, SIGSEGV);
    sigdelset(&set, SIGURG);   // Go's goroutine preemption
    pthread_sigmask(SIG_BLOCK, &set, NULL);
}

// Go unblocks SIGCHLD (and SIGPROF) on every thread its runtime creates,
// whatever the mask it inherited, and in a c-shared library it installs
// no handler of its own for them. A child's SIGCHLD then often lands on a
// Go thread while nginx's main thread blocks it (system() does), and
// nginx's handler reaps the child there: os.execute() gets -1 instead of
// the exit status. So nginx's SIGCHLD handler is wrapped: on any thread
// but the worker's main thread (tid == pid) the signal is sent on to the
// main thread, where it waits until unblocked and then runs nginx's
// handler as usual.

static struct sigaction  loom_go_old_chld;
static pthread_once_t    loom_go_route_once = PTHREAD_ONCE_INIT;

static void
loom_go_chld(int sig, siginfo_t *si, void *uc)
{
    int    err;
    pid_t  pid = getpid();

    if ((pid_t) syscall(SYS_gettid) != pid) {
        err = errno;
        syscall(SYS_tgkill, pid, pid, sig);
        errno = err;
        return;
    }

    if (loom_go_old_chld.sa_flags & SA_SIGINFO) {
        loom_go_old_chld.sa_sigaction(sig, si, uc);

    } else if (loom_go_old_chld.sa_handler != SIG_DFL
               && loom_go_old_chld.sa_handler != SIG_IGN)
    {
        loom_go_old_chld.sa_handler(sig);
    }
}

static void
loom_go_route_signals_once(void)
{
    struct sigaction  sa;

    if (sigaction(SIGCHLD, NULL, &loom_go_old_chld) != 0) {
        return;
    }

    if (!(loom_go_old_chld.sa_flags & SA_SIGINFO)
        && (loom_go_old_chld.sa_handler == SIG_DFL
            || loom_go_old_chld.sa_handler == SIG_IGN))
    {
        // nobody handles SIGCHLD: nothing can be stolen
        return;
    }

    sa = loom_go_old_chld;
    sa.sa_sigaction = loom_go_chld;
    // SA_ONSTACK: the handler may run on a Go thread
    sa.sa_flags = loom_go_old_chld.sa_flags | SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGCHLD, &sa, NULL);
}

static void
loom_go_route_signals(void)
{
    pthread_once(&loom_go_route_once, loom_go_route_signals_once);
}
*/
import "C"

import (
	"fmt"
	"runtime"
	"runtime/cgo"
	"sync"
	"unsafe"
)

// waitMs bounds one host->wait(); the host wakes waiters when it closes
// the queue, so it only limits how long a goroutine sleeps in C.
const waitMs = 1000

type instance struct {
	host    *C.loom_offload_host_t
	queue   *C.loom_offload_queue_t
	handler Handler
	wg      sync.WaitGroup
}

func (in *instance) log(level C.int, msg string) {
	if len(msg) == 0 {
		return
	}
	p := unsafe.Pointer(unsafe.StringData(msg))
	C.loom_go_log(in.host, in.queue, level, (*C.char)(p), C.size_t(len(msg)))
}

func (in *instance) answer(task *C.loom_offload_task_t, status C.int,
	data []byte) {
	var p unsafe.Pointer
	if len(data) > 0 {
		// The host copies the bytes before answer returns; passing a Go
		// pointer for the duration of the call is allowed by cgo.
		p = unsafe.Pointer(&data[0])
	}
	C.loom_go_answer(in.host, task, status, p, C.size_t(len(data)))
}

func (in *instance) serve(index int) {
	defer in.wg.Done()
	// One OS thread per serving goroutine, with signals blocked.
	runtime.LockOSThread()
	C.loom_go_block_signals()
	for {
		var task *C.loom_offload_task_t
		rc := C.loom_go_wait(in.host, in.queue, waitMs, &task)
		if rc == C.LOOM_OFFLOAD_CLOSED {
			return
		}
		if rc != C.LOOM_OFFLOAD_TASK || task == nil {
			continue
		}
		var n C.size_t
		data := C.loom_go_request(in.host, task, &n)
		var payload []byte
		if n > 0 {
			payload = unsafe.Slice((*byte)(unsafe.Pointer(data)), int(n))
		} else {
			payload = []byte{}
		}
		call := &Call{
			payload: payload,
			cancelled: func() bool {
				return C.loom_go_cancelled(in.host, task) != 0
			},
			thread: index,
		}
		rsp, errMsg, ok := safeHandle(in.handler, call)
		if ok {
			in.answer(task, C.LOOM_OFFLOAD_OK, rsp)
		} else {
			in.answer(task, C.LOOM_OFFLOAD_ERROR, []byte(errMsg))
		}
	}
}

func setErr(args *C.loom_offload_init_t, msg string) {
	p := unsafe.Pointer(unsafe.StringData(msg))
	C.loom_go_set_err(args, (*C.char)(p), C.size_t(len(msg)))
}

func newHandler(ctor Constructor, cfg *Config) (h Handler, err error) {
	defer func() {
		if r := recover(); r != nil {
			h, err = nil, fmt.Errorf("panic: %v", r)
		}
	}()
	return ctor(cfg)
}

//export loom_offload_init
func loom_offload_init(args *C.loom_offload_init_t) C.int {
	if args.abi_version < C.LOOM_OFFLOAD_ABI_VERSION || args.host == nil ||
		uintptr(args.host.size) < unsafe.Sizeof(C.loom_offload_host_t{}) {
		setErr(args, "unsupported host ABI version")
		return -1
	}
	C.loom_go_route_signals()
	ctor := registered()
	if ctor == nil {
		setErr(args, "no handler registered (call offload.Register in init)")
		return -1
	}
	threads := int(args.threads)
	if threads < 1 {
		threads = 1
	}
	cfg := &Config{
		Text:    C.GoStringN(args.config, C.int(args.config_len)),
		Threads: threads,
		Worker:  int(args.worker),
	}
	h, err := newHandler(ctor, cfg)
	if err != nil {
		setErr(args, "failed to create handler: "+err.Error())
		return -1
	}
	if h == nil {
		setErr(args, "failed to create handler: constructor returned nil")
		return -1
	}
	in := &instance{host: args.host, queue: args.queue, handler: h}
	in.wg.Add(threads)
	for i := 0; i < threads; i++ {
		go in.serve(i)
	}
	// instance is a C copy of a cgo.Handle: C must not keep Go pointers.
	hd := cgo.NewHandle(in)
	p := C.malloc(C.size_t(unsafe.Sizeof(hd)))
	*(*cgo.Handle)(p) = hd
	args.instance = p
	return 0
}

//export loom_offload_shutdown
func loom_offload_shutdown(p unsafe.Pointer) {
	if p == nil {
		return
	}
	hd := *(*cgo.Handle)(p)
	C.free(p)
	in := hd.Value().(*instance)
	hd.Delete()
	// The queue is closed: goroutines leave once their call is done. One
	// stuck in a call keeps us here; the host stops waiting after its
	// grace period.
	in.wg.Wait()
	if c, ok := in.handler.(Closer); ok {
		func() {
			defer func() {
				if r := recover(); r != nil {
					in.log(C.LOOM_OFFLOAD_LOG_ERR,
						fmt.Sprintf("shutdown panicked: %v", r))
				}
			}()
			c.Close()
		}()
	}
}
