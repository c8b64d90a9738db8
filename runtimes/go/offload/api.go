// Package offload writes resty-loom offload runtimes in Go.
//
// A runtime is a shared library that resty.loom.offload loads into every
// nginx worker. Build a main package that registers a constructor in an
// init function and build it with -buildmode=c-shared:
//
//	package main
//
//	import "resty-loom/offload"
//
//	type upper struct{}
//
//	func (upper) Handle(c *offload.Call) ([]byte, error) {
//		return bytes.ToUpper(c.Payload()), nil
//	}
//
//	func init() {
//		offload.Register(func(*offload.Config) (offload.Handler, error) {
//			return upper{}, nil
//		})
//	}
//
//	func main() {}
//
// The constructor runs on a runtime thread, never on the nginx event
// loop. The handler is shared by all runtime goroutines of the worker, so
// it keeps state between calls (a cache, a connection pool) and must be
// safe for concurrent use. A returned error reaches the Lua caller as
// "runtime error: <message>"; so does a panic, which is recovered and
// written to the nginx error log once ("go handler <type> panic at ..."); the
// goroutine goes on serving the next call.
package offload

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
)

// Config is what the runtime was loaded with.
type Config struct {
	// Text is the configuration string given to offload.load().
	Text string
	// Threads is the number of goroutines serving calls.
	Threads int
	// Worker is the nginx worker id (ngx.worker.id()), -1 outside one.
	Worker int
}

// Get returns the value of key in a configuration written as key=value
// pairs separated by spaces, commas or semicolons.
func (c *Config) Get(key string) (string, bool) {
	fields := strings.FieldsFunc(c.Text, func(r rune) bool {
		return r == ' ' || r == ',' || r == ';' || r == '\n' || r == '\t'
	})
	for _, f := range fields {
		k, v, ok := strings.Cut(f, "=")
		if ok && k == key {
			return v, true
		}
	}
	return "", false
}

// Handler serves calls. Handle may be called from several goroutines at
// once.
type Handler interface {
	Handle(call *Call) ([]byte, error)
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(call *Call) ([]byte, error)

// Handle calls f(call).
func (f HandlerFunc) Handle(call *Call) ([]byte, error) { return f(call) }

// Closer may be implemented by a Handler that holds resources; Close is
// called once when the runtime stops (worker exit or reload), after its
// goroutines served their last call.
type Closer interface {
	Close()
}

// Constructor builds the handler of one loaded runtime.
type Constructor func(cfg *Config) (Handler, error)

var (
	regMu       sync.Mutex
	constructor Constructor
)

// Register sets the constructor used by every offload.load() of this
// library. Call it from an init function of the main package.
func Register(c Constructor) {
	regMu.Lock()
	constructor = c
	regMu.Unlock()
}

func registered() Constructor {
	regMu.Lock()
	defer regMu.Unlock()
	return constructor
}

// Call is one call: the request bytes and a way to see whether the caller
// gave up. A Call is valid only until Handle returns (each serving
// goroutine reuses its own for the next call): do not keep it, nor its
// payload.
type Call struct {
	payload []byte
	in      *instance
	task    *task // nil once answered
	thread  int
}

// Payload returns the request bytes. They belong to the call: they are
// valid until Handle returns; copy them to keep them longer.
func (c *Call) Payload() []byte { return c.payload }

// Cancelled reports whether nobody waits for the answer any more
// (timeout, aborted request, worker shutting down). Long handlers should
// check it now and then and return early.
func (c *Call) Cancelled() bool {
	if c.task == nil {
		return true
	}
	return c.in.cancelled(c.task)
}

// Thread is the index of the goroutine serving this call.
func (c *Call) Thread() int { return c.thread }

// panicLocation finds file:line of the code that panicked: the first
// frame after the runtime's panic machinery.
func panicLocation() string {
	pcs := make([]uintptr, 32)
	n := runtime.Callers(3, pcs)
	frames := runtime.CallersFrames(pcs[:n])
	sawPanic := false
	for {
		f, more := frames.Next()
		if strings.HasPrefix(f.Function, "runtime.") {
			if f.Function == "runtime.gopanic" ||
				strings.HasPrefix(f.Function, "runtime.panic") {
				sawPanic = true
			}
		} else if sawPanic {
			return fmt.Sprintf("%s:%d", f.File, f.Line)
		}
		if !more {
			return ""
		}
	}
}

// safeHandle runs the handler, turning a panic into an error message
// (then panicked is true).
func safeHandle(h Handler, call *Call) (resp []byte, errMsg string, ok,
	panicked bool) {
	defer func() {
		if r := recover(); r != nil {
			loc := panicLocation()
			if loc != "" {
				errMsg = fmt.Sprintf("panic at %s: %v", loc, r)
			} else {
				errMsg = fmt.Sprintf("panic: %v", r)
			}
			resp, ok, panicked = nil, false, true
		}
	}()
	resp, err := h.Handle(call)
	if err != nil {
		return nil, err.Error(), false, false
	}
	return resp, "", true, false
}
