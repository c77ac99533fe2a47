// An AOTInductor package runner whose run() releases the GIL, as ATen's own ops do. torch's Python
// binding of the same loader holds it for the whole graph; then a thread that needs the GIL to finish
// (gloo's worker dropping a collective's tensors, a server's event loop) waits for the graph, and a graph
// that waits on that thread's collective never ends.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/utils/pybind.h>

namespace {

namespace py = pybind11;
using torch::inductor::AOTIModelPackageLoader;

std::vector<at::Tensor> run_released(AOTIModelPackageLoader& loader, const std::vector<at::Tensor>& inputs) {
  py::gil_scoped_release released;
  return loader.run(inputs);
}

// The same positional arguments as torch's binding of the loader, so callers bind either alike.
void load_constants(
    AOTIModelPackageLoader& loader,
    std::unordered_map<std::string, at::Tensor> constants,
    bool use_inactive,
    bool check_full_update,
    bool user_managed) {
  loader.load_constants(constants, use_inactive, check_full_update, user_managed);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // module_local: torch registers its own (derived) loader class; ours never collides with it.
  py::class_<AOTIModelPackageLoader>(m, "GraphRunner", py::module_local())
      .def(
          py::init<const std::string&, const std::string&, bool, size_t, c10::DeviceIndex>(),
          py::arg("package_path"),
          py::arg("model_name") = "model",
          py::arg("run_single_threaded") = false,
          py::arg("num_runners") = 1,
          py::arg("device_index") = -1)
      .def("run", &run_released, py::arg("inputs"))
      .def("load_constants", &load_constants)
      .def("get_constant_fqns", &AOTIModelPackageLoader::get_constant_fqns)
      .def("get_metadata", &AOTIModelPackageLoader::get_metadata);
}
