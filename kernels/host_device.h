// ATTND_HOST_DEVICE for kernels/: the macro lives in base/host_device.h (base/fp8.h shares it).
#ifndef ATTND_KERNELS_HOST_DEVICE_H_
#define ATTND_KERNELS_HOST_DEVICE_H_

#include "base/host_device.h"

#endif  // ATTND_KERNELS_HOST_DEVICE_H_
