/* llm.c's CPU training step, timed as train_gpt2.c's own loop times it, without
 * its validation and sampling passes and with B, T and the files as arguments.
 *
 * It includes karpathy/llm.c's train_gpt2.c (with TESTING defined, which drops
 * that file's main, as llm.c's test_gpt2.c does), so the step is llm.c's code
 * compiled with llm.c's Makefile flags; bench/lm_llmc.py builds and runs it:
 *
 *   gcc -Ofast -march=native -fopenmp -DOMP -I LLM_C_DIR bench/llmc_step.c -lm \
 *       -o llmc_step
 *   OMP_NUM_THREADS=2 ./llmc_step model.bin tokens.bin B T steps
 *
 * Each step: next batch (in file order, no shuffling), forward, zero_grad,
 * backward, AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, no weight decay, llm.c's
 * defaults).  Prints one line per step: "step N loss L ms M".
 */
#define TESTING
#include "train_gpt2.c"

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s model.bin tokens.bin B T steps\n", argv[0]);
        return 2;
    }
    int B = atoi(argv[3]), T = atoi(argv[4]), steps = atoi(argv[5]);
    GPT2 model;
    gpt2_build_from_checkpoint(&model, argv[1]);
    DataLoader loader;
    dataloader_init(&loader, argv[2], B, T, 0, 1, 0);
    struct timespec start, end;
    for (int step = 0; step < steps; step++) {
        clock_gettime(CLOCK_MONOTONIC, &start);
        dataloader_next_batch(&loader);
        gpt2_forward(&model, loader.inputs, loader.targets, B, T);
        gpt2_zero_grad(&model);
        gpt2_backward(&model);
        gpt2_update(&model, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, step + 1);
        clock_gettime(CLOCK_MONOTONIC, &end);
        double ms = (end.tv_sec - start.tv_sec) * 1e3 + (end.tv_nsec - start.tv_nsec) / 1e6;
        printf("step %d loss %.6f ms %.3f\n", step, model.mean_loss, ms);
        fflush(stdout);
    }
    dataloader_free(&loader);
    gpt2_free(&model);
    return 0;
}
