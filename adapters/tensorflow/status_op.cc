// DpPluginStatus: fail the graph with the TensorFlow error code and message
// dp_plugin computed in a tf.numpy_function (adapters/tensorflow/status_op.py). A Python exception in a numpy_function always becomes
// InvalidArgument or Unknown; Horovod's ops fail with FailedPrecondition for
// ranks that disagree, and only a kernel can set that code.
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;

REGISTER_OP("DpPluginStatus")
    .Input("code: int32")
    .Input("message: string")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext*) {
      return absl::OkStatus();
    });

// code 0: nothing happens; any other absl::StatusCode fails the op with
// `message` unchanged.
class DpPluginStatusOp : public OpKernel {
 public:
  explicit DpPluginStatusOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const int code = context->input(0).scalar<tensorflow::int32>()();
    if (code == 0) return;
    const tensorflow::tstring& message = context->input(1).scalar<tensorflow::tstring>()();
    context->SetStatus(absl::Status(static_cast<absl::StatusCode>(code),
                                    std::string(message.data(), message.size())));
  }
};

REGISTER_KERNEL_BUILDER(Name("DpPluginStatus").Device(tensorflow::DEVICE_CPU),
                        DpPluginStatusOp);

}  // namespace
