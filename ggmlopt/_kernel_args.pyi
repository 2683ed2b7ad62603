# cdef-only module: the argument checks the kernel wrappers cimport (see _kernel_args.pxd)
