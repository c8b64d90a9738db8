//go:build go1.24

package offload

// Go 1.24 and later: the hot-path trampolines in runtime.go neither call
// back into Go nor keep a pointer past the call, so their arguments may
// stay on the stack. Older Go (Debian's 1.19) does not know these
// directives and builds runtime.go without them.

/*
#cgo noescape loom_go_next
#cgo nocallback loom_go_next
#cgo noescape loom_go_cancelled
#cgo nocallback loom_go_cancelled
#cgo noescape loom_go_answer
#cgo nocallback loom_go_answer
*/
import "C"
