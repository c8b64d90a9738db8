package offload

/*
#cgo CFLAGS: -I${SRCDIR}/../../../include -O2

#define LOOM_OFFLOAD_NO_PROTOTYPES
#include <loom_offload.h>
#include <errno.h>
#include <signal.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

// cgo cannot call through C function pointers: small trampolines. The
// ones on the hot path never call back into Go nor keep a pointer past
// the call, which noescape.go tells cgo (Go 1.24+), so that arguments stay
// on the stack.

// What loom_go_next() hands to Go: the task taken, its request bytes,
// and a coarse clock (ms) read after the wait.
typedef struct {
    loom_offload_task_t  *task;
    const unsigned char  *data;
    size_t                len;
    int64_t               now_ms;
} loom_go_next_t;

// One cgo call per task on the hot path: answers the previous task (if
// any), waits for the next one and fetches its request bytes. rsp is a
// Go slice's address passed as an integer: the host copies the bytes
// before answer() returns and nothing keeps the address, and the Go side
// keeps the slice alive across the call.
static int
loom_go_next(const loom_offload_host_t *h, loom_offload_queue_t *q,
    loom_offload_task_t *done, int status, uintptr_t rsp, size_t rsp_len,
    int timeout_ms, loom_go_next_t *out)
{
    int              rc;
    struct timespec  ts;

    if (done != NULL) {
        h->answer(done, status, (const void *) rsp, rsp_len);
    }

    out->task = NULL;
    rc = h->wait(q, timeout_ms, &out->task);

    if (rc == LOOM_OFFLOAD_TASK) {
        out->data = h->request(out->task, &out->len);
    }

    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    out->now_ms = (int64_t) ts.tv_sec * 1000 + ts.tv_nsec / 1000000;

    return rc;
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
	"runtime/debug"
	"sync"
	"time"
	"unsafe"
)

// waitMs bounds one host->wait(); the host wakes waiters when it closes
// the queue, so it only limits how long a goroutine sleeps in C.
const waitMs = 1000

// reschedEveryMs is how often a serving goroutine passes through the Go
// scheduler (runtime.Gosched; on a locked thread that costs two thread
// wake-ups). A goroutine locked to its thread that only ever goes from
// one cgo call to the next is never rescheduled, and after 10 ms of that
// Go's sysmon takes its P away at every tick it finds it in C (it cannot
// preempt it there), hands the P to another thread and keeps itself
// waking every 20 us: about a third of the Go runtime's CPU time per call
// went to that churn. One pass through the scheduler every few
// milliseconds resets the clock sysmon goes by.
const reschedEveryMs = 5

// Calls with a payload or an answer of at least bigCall bytes grow the Go
// heap by as much, and Go keeps freed heap for a long while (a worker
// stayed at 137-298 MB after 64 MiB calls). After such calls the package
// gives the memory back: releaseDelay after the last one, a full GC and
// debug.FreeOSMemory(), at most once per releaseEvery.
const (
	bigCall      = 1 << 20
	releaseDelay = 200 * time.Millisecond
	releaseEvery = time.Second
)

var (
	releaseWanted = make(chan struct{}, 1)
	releaseOnce   sync.Once
)

func bigCallDone() {
	releaseOnce.Do(func() { go releaser() })
	select {
	case releaseWanted <- struct{}{}:
	default:
	}
}

func releaser() {
	for range releaseWanted {
		time.Sleep(releaseDelay)
		// big calls that came meanwhile are covered by this release
		select {
		case <-releaseWanted:
		default:
		}
		debug.FreeOSMemory()
		time.Sleep(releaseEvery)
	}
}

type task = C.loom_offload_task_t

type instance struct {
	host    *C.loom_offload_host_t
	queue   *C.loom_offload_queue_t
	handler Handler
	threads int
	wg      sync.WaitGroup
}

func (in *instance) log(level C.int, msg string) {
	if len(msg) == 0 {
		return
	}
	p, n := cBytes(msg)
	C.loom_go_log(in.host, in.queue, level, p, n)
}

func (in *instance) cancelled(t *task) bool {
	return C.loom_go_cancelled(in.host, t) != 0
}

func (in *instance) answer(t *task, status C.int, data []byte) {
	var p unsafe.Pointer
	if len(data) > 0 {
		// The host copies the bytes before answer returns; passing a Go
		// pointer for the duration of the call is allowed by cgo.
		p = unsafe.Pointer(&data[0])
	}
	C.loom_go_answer(in.host, t, status, p, C.size_t(len(data)))
}

func (in *instance) serve(index int) {
	defer in.wg.Done()
	// One OS thread per serving goroutine, with signals blocked; it
	// blocks in host->wait() itself, so a task goes from the host to the
	// handler without any goroutine hand-off, and the answer to one task
	// and the wait for the next are one cgo call.
	runtime.LockOSThread()
	C.loom_go_block_signals()
	// in C memory, so that cgo has no Go pointer to check (cgo's
	// C.malloc never returns nil: it crashes when out of memory)
	next := (*C.loom_go_next_t)(C.malloc(C.size_t(unsafe.Sizeof(
		C.loom_go_next_t{}))))
	defer C.free(unsafe.Pointer(next))
	var (
		done   *task
		status C.int
		rsp    []byte
		last   int64
	)
	empty := []byte{}
	call := &Call{in: in, thread: index}
	for {
		var p uintptr
		if len(rsp) > 0 {
			p = uintptr(unsafe.Pointer(&rsp[0]))
		}
		rc := C.loom_go_next(in.host, in.queue, done, status, C.uintptr_t(p),
			C.size_t(len(rsp)), waitMs, next)
		runtime.KeepAlive(rsp)
		done, rsp = nil, nil
		if rc == C.LOOM_OFFLOAD_CLOSED {
			return
		}
		if rc == C.LOOM_OFFLOAD_TASK {
			// the payload is the host's memory, valid until the answer
			call.payload = empty
			if next.len > 0 {
				call.payload = unsafe.Slice((*byte)(unsafe.Pointer(next.data)),
					int(next.len))
			}
			call.task = next.task
			resp, errMsg, ok, panicked := safeHandle(in.handler, call)
			big := len(resp) >= bigCall || len(call.payload) >= bigCall
			call.task, call.payload = nil, nil
			done, status, rsp = next.task, C.LOOM_OFFLOAD_OK, resp
			if !ok {
				status, rsp = C.LOOM_OFFLOAD_ERROR, []byte(errMsg)
			}
			if panicked {
				// a bug, not an answer: the log says so, once per panic
				in.log(C.LOOM_OFFLOAD_LOG_ERR, fmt.Sprintf("go handler %T %s",
					in.handler, errMsg))
			}
			if big {
				// answered now, not with the next wait: that wait (up to
				// waitMs) would keep the answer alive past the release
				in.answer(done, status, rsp)
				done, rsp = nil, nil
				bigCallDone()
			}
		}
		if now := int64(next.now_ms); now-last >= reschedEveryMs {
			if done != nil {
				// answer first: nobody waits while we reschedule
				in.answer(done, status, rsp)
				done, rsp = nil, nil
			}
			runtime.Gosched()
			last = now
		}
	}
}

// Goroutines blocked in host->wait() hold a P each while they are in C.
// So that they never starve the goroutines that have Go work to do (and
// sysmon does not have to take Ps from them to run those), GOMAXPROCS is
// raised by the number of serving goroutines over what it was when the
// first runtime started, and lowered again when runtimes shut down.
var (
	procsMu   sync.Mutex
	procsBase int
	serving   int
)

func addServing(n int) {
	procsMu.Lock()
	defer procsMu.Unlock()
	if serving == 0 {
		procsBase = runtime.GOMAXPROCS(0)
	}
	serving += n
	runtime.GOMAXPROCS(procsBase + serving)
}

// cBytes: msg's bytes for a C call that copies them before it returns.
// A copy, as Go 1.19 has no unsafe.StringData; only cold paths use it.
func cBytes(msg string) (*C.char, C.size_t) {
	if len(msg) == 0 {
		return nil, 0
	}
	b := []byte(msg)
	return (*C.char)(unsafe.Pointer(&b[0])), C.size_t(len(b))
}

func setErr(args *C.loom_offload_init_t, msg string) {
	p, n := cBytes(msg)
	C.loom_go_set_err(args, p, n)
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
	in := &instance{host: args.host, queue: args.queue, handler: h,
		threads: threads}
	addServing(threads)
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
	addServing(-in.threads)
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
